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
independent seeds and questions (binary outcomes included; McCullagh 2000). The method's test estimates it as

    (MS_seed + max(0, MS_question - MS_within)) / (S n) = var(per-seed mean differences) / S + var_question / n

and refers the mean to a t with S - 1 degrees of freedom: the t-test on the S per-seed mean differences, with the
questions' variance added (the questions are shared by every seed, so the spread of the per-seed means does not
see it). The seed term is kept whatever its estimate. Under the normal model this is conservative for every
between-seed variance (the estimate is a mix of MS_seed's chi-square on S - 1 df and a nearly fixed question part,
whose tails are lighter than t on S - 1 df), and it is exactly the t-test on the per-seed differences where the
question part is estimated 0.

Why not Satterthwaite's df: the test before issue 58 took var_seed = max(0, (MS_seed - MS_within) / n) with
Satterthwaite's df, and the pooled test where var_seed was cut to 0. With 2-3 seeds MS_seed has 1-2 df, and
where it is small by chance, the df jump toward n - 1 in the same studies where t is large: with no true effect
(n = 900, seed sd 4-7 points) it rejected 9-12% at alpha 0.05 with 2 seeds and 7-8% with 3; Clark's min F' with
Satterthwaite's df did no better, and the bare per-seed t-test (no question part) rejected up to 32% where seeds
do not differ. scripts/seed_test_level.py simulates all four. The price of the level: with 2 seeds (t on 1 df)
the method's test rarely rejects; with 3, a gain must stand clear of the seeds' spread.

The same ANOVA takes any crossed array of differences (`over_differences`): two arms trained with the same seeds,
seed s of one minus seed s of the other (the same seed gives the same prompt order), per question.

Why not the other alternatives: a bootstrap over seeds then questions is built for nested data (here the
questions are shared), and 3 seeds give 10 distinct resamples whose spread underestimates the seed variance by
(S-1)/S; statsmodels' MixedLM fits the same crossed model (its REML estimates equal these for a balanced array)
but gives Wald z intervals, too narrow with 2 or 3 seeds, and is iterative where this is closed form.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from slmsql.stats.inference import StatsError, t_inference

METHOD = ("seeds and questions both random (crossed two-way ANOVA of the per-question differences: the t-test on "
          "the per-seed mean differences, df seeds - 1, with the questions' variance added)")


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


def over_seeds(runs: Sequence[Sequence[bool]], baseline: Sequence[bool], alpha: float = 0.05) -> dict:
    """Several seeds vs one baseline, with seeds and questions both random (see the module docstring).

    Returns the estimate (the pooled one: the mean of all d_si), its interval, p, df (seeds - 1) and the variance
    components."""
    b = np.asarray(baseline, dtype=float)
    correct = np.asarray(runs, dtype=float)
    if correct.ndim != 2 or correct.shape[1] != b.size:
        raise StatsError(f"runs must be seeds x {b.size} questions, got shape {correct.shape}")
    return over_differences(correct - b, alpha)


def over_differences(d, alpha: float = 0.05) -> dict:
    """`over_seeds` on a seeds x questions array of differences d_si given directly: any two policies scored
    per seed on the same questions (an arm against another arm, seed s paired with seed s), not only a policy
    against one baseline."""
    c = components(d)
    s, n = c["seeds"], c["n"]
    # S n Var(grand mean) = E MS_seed + E MS_question - E MS_within; the seed term is never dropped
    total = c["ms_seed"] + _positive(c["ms_question"] - c["ms_within"])
    test = t_inference(c["mean"], math.sqrt(total / (s * n)), s - 1, alpha)
    return {**c, "diff": test["mean"], "diff_ci_low": test["ci_low"], "diff_ci_high": test["ci_high"],
            "t": test["t"], "df": test["df"], "p": test["p"], "significant": test["significant"],
            "seed_diff_sd": math.sqrt(_positive(c["ms_seed"] / n)), "method": METHOD}


def summary(runs: Sequence[Sequence[bool]], baseline: Sequence[bool], alpha: float = 0.05) -> dict:
    """A sweep row's method columns (`seed_*`, None with one seed) and the variance components a plan
    (`slmsql plan`) sizes a study from. One seed cannot split the per-question variance: all of it is then
    question variance (var_within 0, the reading under which more seeds would not help) and var_seed is None."""
    if len(runs) < 2:
        return differences_summary([np.asarray(runs[0], dtype=float) - np.asarray(baseline, dtype=float)], alpha)
    return _summary(over_seeds(runs, baseline, alpha))


def differences_summary(d, alpha: float = 0.05) -> dict:
    """`summary` of a seeds x questions array of differences given directly (`over_differences`)."""
    if len(d) < 2:
        one = np.asarray(d[0], dtype=float)
        return {"seed_diff_ci_low": None, "seed_diff_ci_high": None, "seed_df": None, "seed_p": None,
                "seed_diff_sd": None, "var_seed": None,
                "var_question": float(one.var(ddof=1)) if one.size > 1 else 0.0, "var_within": 0.0}
    return _summary(over_differences(d, alpha))


def _summary(r: dict) -> dict:
    return {"seed_diff_ci_low": r["diff_ci_low"], "seed_diff_ci_high": r["diff_ci_high"], "seed_df": r["df"],
            "seed_p": r["p"], **{k: r[k] for k in ("seed_diff_sd", "var_seed", "var_question", "var_within")}}
