"""The figures runs log: pass-rate histogram (filter), EX with intervals beside the baseline (evaluate), training
curves (grpo), the sweep's forest plot of each variant's pooled difference."""

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


def forest_figure(report: dict):
    """A sweep's forest plot: per eval set, each variant's pooled EX difference vs the starting policy with its
    interval (blue: improved, red: regressed, black: no significant difference after Holm), and each seed's
    own difference as a grey dot: the spread a single seed would have hidden."""
    plt = _pyplot()
    sets, variants = report["eval_sets"], [v["label"] for v in report["variants"]]
    fig, axes = plt.subplots(1, len(sets), figsize=(4.5 * len(sets), 0.5 * len(variants) + 1.6), squeeze=False,
                             sharey=True)
    colors = {"improved": "#36c", "regressed": "#c33"}
    for ax, es in zip(axes[0], sets):
        rows = {r["variant"]: r for r in report["rows"] if r["eval_set"] == es["name"]}
        for y, label in enumerate(variants):
            r = rows[label]
            color = colors.get(r["verdict"], "k")
            ax.plot([100 * r["diff_ci_low"], 100 * r["diff_ci_high"]], [y, y], color=color, lw=1.5)
            ax.plot(100 * r["diff"], y, "s", color=color)
            ax.plot([100 * (x - r["ex_b"]) for x in r["ex_seeds"]], [y] * len(r["ex_seeds"]), "o", ms=3,
                    color="#999", zorder=0)
        ax.axvline(0, color="#888", lw=0.8, ls="--")
        ax.set_yticks(range(len(variants)), variants, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(f"EX difference, points ({1 - report['alpha']:.0%} CI)")
        start = "" if len(report.get("starts", [])) > 1 else f", start {100 * es['ex_b']:.1f}%"  # else per row
        ax.set_title(f"{es['name']} (n = {es['n']}{start})", fontsize=9)
    fig.tight_layout()
    return fig
