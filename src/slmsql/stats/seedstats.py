"""Seeds as a second random unit: an inference that speaks for the method, not only for the seeds trained.

`stats.compare_seeds` tests the mean over questions of d_si = correct[s][i] - baseline[i] with the questions as
the only random unit: its verdict is about *these* trained seeds. Training again (another seed, another
machine's float path) draws new seeds, so a claim about "GRPO at these settings" must also count the spread
between seeds. Every seed answers the same questions against the same baseline, so seeds and questions are
crossed, not nested: a seeds x questions array. Its two-way random-effects ANOVA (Satterthwaite 1946; the
"language-as-fixed-effect" problem of Clark 1973, with seeds in the place of the items) splits the variance
into a seed part, a question part and the rest, with expected mean squares

    E MS_seed = n var_seed + var_within,  E MS_question = S var_question + var_within,  E MS_within = var_within,

and Var(grand mean) = var_seed / S + var_question / n + var_within / (S n), unbiased for any crossed array of
independent seeds and questions (binary outcomes included; McCullagh 2000). The pooled test's variance is
MS_question / (S n); the method's adds the seed part, var_seed / S with var_seed = max(0, (MS_seed -
MS_within) / n), and its t reference takes Satterthwaite's degrees of freedom. Where the seeds spread no more
than their per-question noise explains (var_seed estimated 0) the two inferences are the same test.

The same ANOVA takes any crossed array of differences (`over_differences`): two arms trained with the same seeds,
seed s of one minus seed s of the other (the same seed gives the same prompt order), per question.

Why not the alternatives: a bootstrap over seeds then questions is built for nested data (here the questions
are shared), and 3 seeds give 10 distinct resamples whose spread underestimates the seed variance by (S-1)/S;
statsmodels' MixedLM fits the same crossed model (its REML estimates equal these for a balanced array) but
gives Wald z intervals, too narrow with 2 or 3 seeds, and is iterative where this is closed form.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from slmsql.stats.inference import StatsError, paired_t, t_inference

METHOD = ("seeds and questions both random (crossed two-way ANOVA of the per-question differences; the pooled "
          "variance plus the between-seed part, Satterthwaite df)")


def components(d) -> dict:
    """Mean squares and variance components of a seeds x questions array of differences (S >= 2, n >= 2)."""
    d = np.asarray(d, dtype=float)
    if d.ndim != 2 or d.shape[0] < 2 or d.shape[1] < 2:
        raise StatsError(f"variance components need at least 2 seeds x 2 questions, got {d.shape}")
    s, n = d.shape
    grand, by_seed, by_q = d.mean(), d.mean(axis=1), d.mean(axis=0)
    ms_seed = n * float(((by_seed - grand) ** 2).sum()) / (s - 1)
    ms_q = s * float(((by_q - grand) ** 2).sum()) / (n - 1)
    ms_w = float(((d - by_seed[:, None] - by_q[None, :] + grand) ** 2).sum()) / ((s - 1) * (n - 1))
    return {"seeds": s, "n": n, "mean": float(grand), "ms_seed": ms_seed, "ms_question": ms_q, "ms_within": ms_w,
            # method-of-moments estimates, truncated at 0 (a variance cannot be negative)
            "var_seed": _positive(ms_seed - ms_w) / n, "var_question": _positive(ms_q - ms_w) / s,
            "var_within": _positive(ms_w)}


def _positive(x: float) -> float:
    """x, or 0 where it is negative or rounding (identical seeds leave ~1e-33 where the sum is 0)."""
    return x if x > 1e-12 else 0.0


def satterthwaite(terms: Sequence[tuple[float, float, float]]) -> float:
    """Degrees of freedom of sum(c * MS) for (c, MS, df) terms: (sum c MS)^2 / sum((c MS)^2 / df)."""
    num = sum(c * ms for c, ms, _ in terms) ** 2
    den = sum((c * ms) ** 2 / df for c, ms, df in terms)
    return num / den if den > 0 else math.inf


def over_seeds(runs: Sequence[Sequence[bool]], baseline: Sequence[bool], alpha: float = 0.05) -> dict:
    """Several seeds vs one baseline, with seeds and questions both random (see the module docstring).

    Returns the estimate (the pooled one: the mean of all d_si), its interval, p, df, the variance components
    and `seed_part`: whether the between-seed part entered (False: the result is the pooled t-test's)."""
    b = np.asarray(baseline, dtype=float)
    correct = np.asarray(runs, dtype=float)
    if correct.ndim != 2 or correct.shape[1] != b.size:
        raise StatsError(f"runs must be seeds x {b.size} questions, got shape {correct.shape}")
    # the pooled per-question differences as stats.compare_seeds computes them, so that without a seed part the
    # result is its test to the bit
    return over_differences(correct - b, alpha, pooled=correct.mean(axis=0) - b)


def over_differences(d, alpha: float = 0.05, pooled=None) -> dict:
    """`over_seeds` on a seeds x questions array of differences d_si given directly: any two policies scored
    per seed on the same questions (an arm against another arm, seed s paired with seed s), not only a policy
    against one baseline. `pooled`: the per-question differences the pooled test takes where there is no seed
    part (default: d's column means; a caller passes its own computation of them to get its test to the bit)."""
    c = components(d)
    s, n = c["seeds"], c["n"]
    if c["var_seed"] > 0:  # the pooled variance MS_question / (S n) plus var_seed / S
        combo = [(1.0, c["ms_question"], n - 1), (1.0, c["ms_seed"], s - 1), (-1.0, c["ms_within"], (s - 1) * (n - 1))]
        df = satterthwaite(combo)
        test = t_inference(c["mean"], math.sqrt(sum(k * ms for k, ms, _ in combo) / (s * n)), df, alpha)
    else:  # no seed part: the pooled test itself (stats.compare_seeds' computation)
        test = paired_t(np.asarray(d, dtype=float).mean(axis=0) if pooled is None else pooled, alpha)
    return {**c, "diff": test["mean"], "diff_ci_low": test["ci_low"], "diff_ci_high": test["ci_high"],
            "t": test["t"], "df": test["df"], "p": test["p"], "significant": test["significant"],
            "seed_part": c["var_seed"] > 0, "method": METHOD}


def summary(runs: Sequence[Sequence[bool]], baseline: Sequence[bool], alpha: float = 0.05) -> dict:
    """A sweep row's method columns (`seed_*`, None with one seed) and the variance components a plan
    (`slmsql plan`) sizes a study from. One seed cannot split the per-question variance: all of it is then
    question variance (var_within 0, the reading under which more seeds would not help) and var_seed is None."""
    if len(runs) < 2:
        return differences_summary([np.asarray(runs[0], dtype=float) - np.asarray(baseline, dtype=float)], alpha)
    return _summary(over_seeds(runs, baseline, alpha))


def differences_summary(d, alpha: float = 0.05, pooled=None) -> dict:
    """`summary` of a seeds x questions array of differences given directly (`over_differences`)."""
    if len(d) < 2:
        one = np.asarray(d[0], dtype=float)
        return {"seed_diff_ci_low": None, "seed_diff_ci_high": None, "seed_df": None, "seed_p": None,
                "var_seed": None, "var_question": float(one.var(ddof=1)) if one.size > 1 else 0.0, "var_within": 0.0}
    return _summary(over_differences(d, alpha, pooled))


def _summary(r: dict) -> dict:
    return {"seed_diff_ci_low": r["diff_ci_low"], "seed_diff_ci_high": r["diff_ci_high"], "seed_df": r["df"],
            "seed_p": r["p"], **{k: r[k] for k in ("var_seed", "var_question", "var_within")}}
