"""Numbers in words: how a rate, a difference in points, a p-value and a duration are written, the same in
the model card (as Jinja filters) and in the MLflow run descriptions."""

from __future__ import annotations


def pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def pts(x) -> str:
    """A signed difference in points, with a true minus sign; a difference that rounds to 0 is "0.0" (not −0.0)."""
    if x is None:
        return "n/a"
    v = round(100 * x, 1)
    return "0.0" if v == 0 else f"{v:+.1f}".replace("-", "−")


def bound(x, minus: str = "−") -> str:
    """An interval's bound in points: as `pts`, but a bound that rounds to 0 and is not 0 gets one more digit
    (−0.04, +0.03), so which side of 0 it lies on shows (an interval [−2.4, 0.0] reads as touching 0 when it
    excludes it)."""
    if x is None:
        return "n/a"
    v = 100 * x
    text = f"{v:+.1f}" if v == 0 or round(v, 1) != 0 else f"{v:+.2f}"
    return ("0.0" if v == 0 else text).replace("-", minus)


def pval(p) -> str:
    return "n/a" if p is None else ("< 0.001" if p < 0.001 else f"{p:.3f}" if p < 0.01 else f"{p:.2f}")


def points(x) -> str:
    """A spread in points, unsigned."""
    return "n/a" if x is None else f"{100 * x:.1f}"


def duration(seconds) -> str:
    """Seconds under 90 s, else whole minutes (and hours)."""
    if seconds is None:
        return "n/a"
    if seconds < 90:
        return f"{seconds:.0f} s"
    h, m = divmod(round(seconds / 60), 60)
    return f"{h} h {m} min" if h else f"{m} min"


def training_time(steps, seconds, resumed_at_step=None) -> str:
    """How long training took, as measured: a run resumed from a checkpoint (GRPO's `--resume`) timed only the
    steps after it, in its last attempt, and says so (its earlier attempts' time is not known to it)."""
    if not resumed_at_step:
        return duration(seconds)
    return (f"{duration(seconds)} for steps {resumed_at_step + 1:.0f}-{steps:.0f} (resumed from its step-"
            f"{resumed_at_step:.0f} checkpoint; the time before it is not counted)")


SHORT_VERDICT = {"no significant difference": "no sig. difference"}


def result(c: dict) -> str:
    """A paired comparison (`stats.compare`: side `a` this run, `b` the baseline) in one table cell, e.g.
    `37.0% vs 39.5%, −2.5 pts [−6.7, +2.4], p 0.38, no sig. difference`."""
    return (f"{pct(c['ex_a'])} vs {pct(c['ex_b'])}, {pts(c['diff'])} pts [{pts(c['diff_ci_low'])}, "
            f"{pts(c['diff_ci_high'])}], p {pval(c['mcnemar_p'])}, {SHORT_VERDICT.get(c['verdict'], c['verdict'])}")


def ex_result(m: dict) -> str:
    """An evaluation without a baseline in one cell: `37.0% [29.1%, 45.2%]` (EX and its Wilson interval)."""
    return f"{pct(m['ex'])} [{pct(m['ex_ci_low'])}, {pct(m['ex_ci_high'])}]"


def band_result(summary: dict) -> str:
    """A filter run in one cell: `band 24 of 64 (0.2 < p < 0.8)`."""
    return f"band {summary['buckets']['band']} of {summary['n_source']} ({summary['low']} < p < {summary['high']})"


def signal_result(summary: dict) -> str:
    """A GRPO run's learning signal in one cell: `correctness varied in 40% of groups, 60% zero-variance`."""
    varies, zero = summary.get("summary/exec/frac_groups_correctness_varies"), summary.get("summary/frac_reward_zero_std")
    return ("correctness varied in " + ("n/a" if varies is None else f"{varies:.0%}") + " of groups, "
            + ("n/a" if zero is None else f"{zero:.0%}") + " zero-variance")


def sft_result(summary: dict) -> str:
    """An SFT run in one cell: `loss 0.412 after 400 steps`."""
    return f"loss {summary['train_loss']:.3g} after {summary['steps']} steps"
