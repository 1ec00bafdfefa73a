"""The figures runs log: pass-rate histogram (filter), EX with intervals beside the baseline (evaluate), the
sweep's forest plot of each variant's pooled difference."""

from __future__ import annotations


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def histogram_figure(summary: dict):
    plt = _pyplot()
    k, low, high = summary["k"], summary["low"], summary["high"]
    fig, ax = plt.subplots(figsize=(5, 3))
    for i, (label, n) in enumerate(summary["histogram"].items()):
        p = i / k
        color = "#36c" if low < p < high else ("#c63" if i in (0, k) else "#aaa")
        ax.bar(i, n, color=color)
    ax.set_xticks(range(k + 1), list(summary["histogram"]), fontsize=8)
    ax.set_xlabel(f"pass rate (blue: band {low} < p < {high}; grey: in no main bucket)")
    ax.set_ylabel("questions")
    fig.tight_layout()
    return fig


def ex_figure(metrics: dict, comparison: dict | None, label: str):
    """EX with Wilson intervals, this run beside its baseline: the picture a reader checks first."""
    plt = _pyplot()
    bars = [(label, metrics["ex"], metrics["ex_ci_low"], metrics["ex_ci_high"])]
    if comparison:
        bars.insert(0, ("baseline", comparison["ex_b"], comparison["ex_b_ci_low"], comparison["ex_b_ci_high"]))
    fig, ax = plt.subplots(figsize=(4, 3))
    for i, (name, ex, lo, hi) in enumerate(bars):
        ax.bar(i, ex * 100, color="#8aa" if name == "baseline" else "#36c")
        # clamped: statsmodels' Wilson bound for k == n is 0.9999999999999999, and a negative yerr raises
        ax.errorbar(i, ex * 100, yerr=[[max(0.0, 100 * (ex - lo))], [max(0.0, 100 * (hi - ex))]], color="k",
                    capsize=6)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars])
    ax.set_ylabel("EX % (95% Wilson)")
    ax.set_ylim(0, 100)
    if comparison:
        ax.set_title(f"{comparison['verdict']} (McNemar p={comparison['mcnemar_p']:.3g})", fontsize=9)
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
        ax.set_title(f"{es['name']} (n = {es['n']}, start {100 * es['ex_b']:.1f}%)", fontsize=9)
    fig.tight_layout()
    return fig
