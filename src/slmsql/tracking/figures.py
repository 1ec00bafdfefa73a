"""The figures runs log: pass-rate histogram (filter), EX with intervals beside the baseline (evaluate), training
curves (grpo), the forest plot of each comparison's pooled difference (a sweep's, a study's)."""

from __future__ import annotations


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def histogram_figure(summary: dict):
    """Questions per pass rate i/K, coloured by bucket, with every colour in the legend."""
    from matplotlib.patches import Patch

    plt = _pyplot()
    k, low, high = summary["k"], summary["low"], summary["high"]
    colors = {"band": "#36c", "ends": "#c63", "out": "#aaa"}
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for i, (label, n) in enumerate(summary["histogram"].items()):
        p = i / k
        kind = "band" if low < p < high else ("ends" if i in (0, k) else "out")
        ax.bar(i, n, color=colors[kind])
        ax.annotate(str(n), (i, n), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(k + 1), list(summary["histogram"]), fontsize=8)
    ax.set_xlabel(f"pass rate (K = {k} samples per question)")
    ax.set_ylabel("questions")
    ax.margins(y=0.12)
    ax.legend(handles=[Patch(color=colors["band"], label=f"band {low} < p < {high} (RL data)"),
                       Patch(color=colors["ends"], label=f"all fail 0/{k}, all pass {k}/{k}"),
                       Patch(color=colors["out"], label="out of band")], fontsize=7, frameon=False)
    fig.tight_layout()
    return fig


def ex_figure(metrics: dict, comparison: dict | None, label: str, baseline_label: str = "baseline"):
    """EX with its interval, this run beside its baseline (both named), on an axis fitted to the intervals:
    points with error bars, not bars, because a bar on an axis that does not start at 0 misleads."""
    plt = _pyplot()
    rows = [(label, metrics["ex"], metrics["ex_ci_low"], metrics["ex_ci_high"], "#36c")]
    if comparison:  # both intervals from the comparison: one confidence level, 1 - alpha
        rows = [(label, comparison["ex_a"], comparison["ex_a_ci_low"], comparison["ex_a_ci_high"], "#36c"),
                (baseline_label, comparison["ex_b"], comparison["ex_b_ci_low"], comparison["ex_b_ci_high"],
                 "#888")][::-1]
    fig, ax = plt.subplots(figsize=(5.5, 1.3 + 0.6 * len(rows)))
    for i, (name, ex, lo, hi, color) in enumerate(rows):
        # clamped: statsmodels' Wilson bound for k == n is 0.9999999999999999, and a negative xerr raises
        ax.errorbar(100 * ex, i, xerr=[[max(0.0, 100 * (ex - lo))], [max(0.0, 100 * (hi - ex))]], fmt="o",
                    color=color, capsize=5, markersize=7)
    lows, highs = [100 * r[2] for r in rows], [100 * r[3] for r in rows]
    pad = max(2.0, 0.15 * (max(highs) - min(lows)))
    ax.set_xlim(max(-2.0, min(lows) - pad), min(102.0, max(highs) + pad))  # room for a marker at 0 or 100
    ax.set_ylim(-0.6, len(rows) - 0.3)
    ax.set_yticks(range(len(rows)), [f"{name}\n{100 * ex:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"
                                      for name, ex, lo, hi, _ in rows], fontsize=8)
    ax.set_xlabel("EX % (95% Wilson interval)" if not comparison else "EX % (Wilson interval at 1 − α)")
    if comparison:
        c = comparison
        ax.set_title(f"{c['verdict']}\n{100 * c['diff']:+.1f} points [{100 * c['diff_ci_low']:+.1f}, "
                     f"{100 * c['diff_ci_high']:+.1f}], McNemar p = {c['mcnemar_p']:.3g}", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


CURVES = (("reward", "reward (mean per completion)"), ("reward_std", "reward std within groups"),
          ("exec/frac_groups_correctness_varies", "groups with varying correctness"))


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def training_curves(log_history: list[dict]):
    """GRPO's signal over steps: reward, reward std and the share of groups whose correctness varies, raw
    (faint) and smoothed over ~1/10 of the run. None when the run logged none of them."""
    plt = _pyplot()
    series = {key: [(h["step"], h[key]) for h in log_history if isinstance(h.get(key), (int, float)) and "step" in h]
              for key, _ in CURVES}
    if not any(series.values()):
        return None
    steps = max(len(v) for v in series.values())
    window = max(1, steps // 10)
    fig, axes = plt.subplots(len(CURVES), 1, figsize=(6, 5.4), sharex=True)
    for ax, (key, title) in zip(axes, CURVES):
        points = series[key]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, color="#36c", alpha=0.25, linewidth=1)
            ax.plot(xs, smooth(list(ys), window), color="#36c", linewidth=2)
        ax.set_title(f"{title}  ({key})", fontsize=9, loc="left")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel(f"step (thick: moving average over {window} step{'s' if window > 1 else ''})")
    fig.tight_layout()
    return fig


def forest_figure(report: dict, label: str = "variant"):
    """A forest plot: per eval set, each row's pooled EX difference with its interval (blue: improved, red:
    regressed, black: no significant difference after Holm), and each seed's own difference as a grey dot: the
    spread a single seed would have hidden. Rows are named by their `label` key: a sweep's variants against the
    starting policy, a study's comparisons ("dense vs outcome"), each seed's difference then `diff_seeds`. A row
    without a verdict (a study's, records missing) is drawn hollow and dashed from the seeds present, and one
    with nothing to estimate from is named and left empty."""
    plt = _pyplot()
    sets = report["eval_sets"]
    names = list(dict.fromkeys(r[label] for r in report["rows"]))  # a sweep's variant order, a study's family's
    fig, axes = plt.subplots(1, len(sets), figsize=(4.5 * len(sets), 0.5 * len(names) + 1.6), squeeze=False,
                             sharey=True)
    colors = {"improved": "#36c", "regressed": "#c33"}
    note = "\nhollow, dashed: no verdict (records missing)" if any(r["verdict"] is None for r in report["rows"]) else ""
    for ax, es in zip(axes[0], sets):
        drawn = False
        for r in (r for r in report["rows"] if r["eval_set"] == es["name"]):
            y = names.index(r[label])
            if r["diff"] is None:  # named in the middle of the panel, whatever its scale
                ax.annotate("records missing", (0.5, y), xycoords=("axes fraction", "data"), ha="center",
                            va="center", fontsize=7, color="#888")
                continue
            drawn = True
            color, hollow = colors.get(r["verdict"], "k"), r["verdict"] is None
            ax.plot([100 * r["diff_ci_low"], 100 * r["diff_ci_high"]], [y, y], color=color, lw=1.5,
                    ls="--" if hollow else "-")
            ax.plot(100 * r["diff"], y, "s", color=color, mfc="white" if hollow else color)
            seeds = r["diff_seeds"] if "diff_seeds" in r else [x - r["ex_b"] for x in r["ex_seeds"]]
            ax.plot([100 * x for x in seeds], [y] * len(seeds), "o", ms=3, color="#999", zorder=0)
        ax.axvline(0, color="#888", lw=0.8, ls="--")
        if not drawn:  # nothing estimated yet: a scale around 0 rather than matplotlib's 0..1
            ax.set_xlim(-10, 10)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_ylim(len(names) - 0.5, -0.5)  # the first row on top
        ax.set_xlabel(f"EX difference, points ({1 - report['alpha']:.0%} CI){note}")
        several = len(report.get("starts", [])) > 1 or es.get("ex_b") is None  # else per row, or no start
        start = "" if several else f", start {100 * es['ex_b']:.1f}%"
        ax.set_title(f"{es['name']} (n = {'n/a' if es['n'] is None else es['n']}{start})", fontsize=9)
    fig.tight_layout()
    return fig
