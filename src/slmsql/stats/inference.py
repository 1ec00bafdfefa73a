"""Statistics for execution accuracy (EX): what a difference between two runs on the same questions supports.

Runs are compared *paired* (same questions). One comparison has one inference: McNemar's exact test and an
interval of the EX difference from the same exact conditional model (Clopper-Pearson on the discordant pairs),
so the interval excludes 0 exactly when the test rejects. Several training seeds against one baseline are
pooled per question (`compare_seeds`). Per-run accuracy gets a Wilson interval, which behaves at small n and
near 0/1.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Sequence

import numpy as np
from scipy.optimize import brentq
from scipy.stats import norm
from scipy.stats import t as student_t
from statsmodels.stats.proportion import proportion_confint

from slmsql.errors import SlmsqlError

DIFF_CI_METHOD = ("exact conditional (Clopper-Pearson on the discordant pairs), consistent with McNemar's "
                  "exact test")
POOLED_METHOD = ("paired t-test on per-question differences (mean over seeds minus baseline), with the matching "
                 "t interval")


class StatsError(SlmsqlError, ValueError):
    """Input that no statistic can be computed from (empty, mismatched, counts out of range)."""


def _check_alpha(alpha: float) -> None:
    if not 0 < alpha < 1:
        raise StatsError(f"alpha must lie strictly between 0 and 1, got {alpha}")


def _check_counts(k: int, n: int, name: str = "k") -> None:
    if n <= 0:
        raise StatsError(f"n must be positive, got n={n}: no examples were scored")
    if not 0 <= k <= n:
        raise StatsError(f"{name}={k} is outside 0..n={n}")


def wilson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    _check_counts(k, n)
    lo, hi = proportion_confint(k, n, alpha=1 - confidence, method="wilson")
    # statsmodels returns 0.9999999999999999 for k == n: keep the interval around the estimate it bounds
    return min(float(lo), k / n), max(float(hi), k / n)


def _paired(a: Sequence[bool], b: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    if a.ndim != 1 or a.shape != b.shape:
        raise StatsError(f"paired results must be equal-length 1-D sequences, got {a.shape} and {b.shape}")
    if a.size == 0:
        raise StatsError("n must be positive, got n=0: no examples were scored")
    return a, b


def paired_table(a: Sequence[bool], b: Sequence[bool]) -> dict:
    a, b = _paired(a, b)
    return {"both_right": int(np.sum(a & b)), "only_a": int(np.sum(a & ~b)),
            "only_b": int(np.sum(~a & b)), "both_wrong": int(np.sum(~a & ~b))}


def _mcnemar_fraction(only_a: int, only_b: int) -> Fraction:
    """Exact two-sided (doubled) McNemar p as a fraction: 2 P(X <= min) for X ~ Binomial(n_d, 1/2), capped at 1.

    Exact arithmetic because the verdict compares p with alpha, and p can equal a dyadic alpha (1/16, 1/32)
    exactly: there the interval's bound is exactly 0 and a rounded p must not tip the verdict.
    """
    if only_a < 0 or only_b < 0:
        raise StatsError(f"discordant counts must be >= 0, got only_a={only_a}, only_b={only_b}")
    n_d, m = only_a + only_b, min(only_a, only_b)
    if n_d == 0 or 2 * m >= n_d:
        return Fraction(1)  # no discordant pairs, or a perfect balance: no evidence of any difference
    tail, c = 0, 1
    for k in range(m + 1):  # sum of C(n_d, k), k = 0..m
        tail += c
        c = c * (n_d - k) // (k + 1)
    return min(Fraction(1), Fraction(2 * tail, 2 ** n_d))


def mcnemar_exact(only_a: int, only_b: int) -> float:
    return float(_mcnemar_fraction(only_a, only_b))


def _agree(lo: float, hi: float, significant: bool, tol: float = 1e-9) -> tuple[float, float]:
    """Make an interval agree with its own test where floating point put a bound on the wrong side of 0.

    Mathematically the closed interval excludes 0 exactly when the test rejects; a bound that disagrees by more
    than rounding is a bug, not a boundary case, and raises.
    """
    if significant and lo <= 0 <= hi:
        if abs(lo) <= tol:
            return math.ulp(0.0), hi
        if abs(hi) <= tol:
            return lo, -math.ulp(0.0)
    elif not significant and not lo <= 0 <= hi:
        if 0 < lo <= tol:
            return 0.0, hi
        if -tol <= hi < 0:
            return lo, 0.0
    else:
        return lo, hi
    raise AssertionError(f"interval [{lo}, {hi}] disagrees with the test (significant={significant})")


def exact_paired(only_a: int, only_b: int, n: int, alpha: float = 0.05) -> dict:
    """McNemar's exact test and the matching interval of the EX difference (only_a - only_b) / n.

    Conditional on the n_d = only_a + only_b discordant pairs, only_a ~ Binomial(n_d, p), and the runs have
    equal EX iff p = 1/2. The Clopper-Pearson interval [p_lo, p_hi] at confidence 1 - alpha maps to the
    difference as n_d / n * (2 [p_lo, p_hi] - 1). p_lo > 1/2 iff P(X >= only_a | 1/2) < alpha/2 (and
    likewise p_hi < 1/2 for the other tail), which is the doubled exact p below alpha: the interval excludes
    0 exactly when p < alpha, and at p == alpha its bound is exactly 0 (not significant). There, the beta
    quantiles can miss 1/2 by ~1e-15 (e.g. 11 vs 3), which `_agree` puts back on the test's side.
    """
    _check_alpha(alpha)
    p = _mcnemar_fraction(only_a, only_b)
    n_d = only_a + only_b
    if not 0 <= n_d <= n:
        raise StatsError(f"only_a + only_b = {n_d} is outside 0..n={n}")
    significant = p < Fraction(alpha)
    if n_d == 0:
        lo = hi = 0.0
    else:
        p_lo, p_hi = proportion_confint(only_a, n_d, alpha=alpha, method="beta")
        lo, hi = _agree(n_d / n * (2 * float(p_lo) - 1), n_d / n * (2 * float(p_hi) - 1), significant)
    return {"p": float(p), "diff_ci_low": lo, "diff_ci_high": hi, "significant": significant}


def paired_t(d: Sequence[float], alpha: float = 0.05) -> dict:
    """One-sample t-test of mean(d) = 0 and the t interval of mean(d): one computation, so they agree."""
    d = np.asarray(d, dtype=float)
    if d.ndim != 1 or d.size < 2:
        raise StatsError(f"a t-test needs at least 2 questions, got {d.size}")
    return t_inference(float(d.mean()), float(d.std(ddof=1)) / math.sqrt(d.size), d.size - 1, alpha)


def t_inference(mean: float, se: float, df: float, alpha: float = 0.05) -> dict:
    """Test of mean = 0 and the interval mean +- t_{1-alpha/2, df} se, which excludes 0 exactly when
    |t| > t_{1-alpha/2, df}, i.e. p < alpha. When se = 0 the interval is the mean and p is 1 (mean 0) or 0."""
    _check_alpha(alpha)
    if se == 0:
        t_stat, p, lo, hi = (0.0 if mean == 0 else math.copysign(math.inf, mean)), float(mean == 0), mean, mean
    else:
        t_stat = mean / se
        p = float(2 * student_t.sf(abs(t_stat), df))
        half = float(student_t.ppf(1 - alpha / 2, df)) * se
        lo, hi = mean - half, mean + half
    significant = p < alpha
    lo, hi = _agree(lo, hi, significant)
    return {"mean": mean, "ci_low": lo, "ci_high": hi, "t": t_stat, "df": df, "p": p, "significant": significant}


def min_detectable_difference(n: int, p_base: float, discordance: float | None = None,
                              alpha: float = 0.05, power: float = 0.8) -> float:
    """Smallest EX gain over `p_base` that a two-sided McNemar test on n paired questions detects with `power`.

    Method: Connor's (1987) normal approximation for McNemar's test,
        n = (z_{1-alpha/2} sqrt(psi) + z_{power} sqrt(psi - delta^2))^2 / delta^2,
    solved for delta (the difference in EX) with psi = P(the runs disagree on a question).
    Assumptions: questions are independent; `discordance` is psi (e.g. observed (only_a + only_b) / n); when
    None, the runs' errors are assumed independent, psi = p_a(1-p_b) + p_b(1-p_a). Real fine-tunes of one base
    agree far more than that, so None is pessimistic (a larger MDD). The normal approximation is rough when
    n * psi is small (under ~20 discordant pairs). Returns inf when no possible difference is detectable.
    """
    if n <= 0:
        raise StatsError(f"n must be positive, got n={n}")
    if not 0 <= p_base <= 1 or (discordance is not None and not 0 <= discordance <= 1):
        raise StatsError(f"p_base={p_base} and discordance={discordance} must lie in [0, 1]")
    za, zb = norm.ppf(1 - alpha / 2), norm.ppf(power)

    def psi(d: float) -> float:
        return discordance if discordance is not None else (p_base + d) * (1 - p_base) + p_base * (1 - p_base - d)

    def n_needed(d: float) -> float:
        s = psi(d)
        return (za * math.sqrt(s) + zb * math.sqrt(max(s - d * d, 0.0))) ** 2 / (d * d)

    # delta can be at most psi (every disagreement favours a) and at most 1 - p_base (a is perfect)
    hi = min(1 - p_base, discordance if discordance is not None else 1.0)
    if hi <= 0 or n_needed(hi) > n:
        return math.inf
    return float(brentq(lambda d: n_needed(d) - n, 1e-9, hi, xtol=1e-9))


def _verdict(significant: bool, diff: float) -> str:
    if significant and diff != 0:
        return "improved" if diff > 0 else "regressed"
    return "no significant difference"


def verdict(p_value: float, diff: float, alpha: float = 0.05) -> str:
    return _verdict(p_value < alpha, diff)


def compare(a: Sequence[bool], b: Sequence[bool], alpha: float = 0.05) -> dict:
    """Run `a` vs baseline `b` on the same questions, as a flat dict of numbers (MLflow metrics) plus `verdict`
    and `diff_ci_method`. Test, interval and verdict come from one computation (`exact_paired`)."""
    _check_alpha(alpha)
    t = paired_table(a, b)
    n = sum(t.values())
    k_a, k_b = t["both_right"] + t["only_a"], t["both_right"] + t["only_b"]
    conf = 1 - alpha
    (a_lo, a_hi), (b_lo, b_hi) = wilson(k_a, n, conf), wilson(k_b, n, conf)
    exact = exact_paired(t["only_a"], t["only_b"], n, alpha)
    disc = (t["only_a"] + t["only_b"]) / n
    diff = (k_a - k_b) / n
    return {
        "n": n, "ex_a": k_a / n, "ex_b": k_b / n,
        "ex_a_ci_low": a_lo, "ex_a_ci_high": a_hi, "ex_b_ci_low": b_lo, "ex_b_ci_high": b_hi,
        "diff": diff, "diff_ci_low": exact["diff_ci_low"], "diff_ci_high": exact["diff_ci_high"],
        "diff_ci_method": DIFF_CI_METHOD, **t, "mcnemar_p": exact["p"],
        # observed discordance when there is any; with none, fall back to the independence assumption
        "mdd": min_detectable_difference(n, k_b / n, disc or None, alpha=alpha),
        "verdict": _verdict(exact["significant"], diff),
    }


def compare_seeds(runs: Sequence[Sequence[bool]], baseline: Sequence[bool], alpha: float = 0.05) -> dict:
    """Several training seeds of one method vs ONE baseline run, all scored on the same questions.

    The unit is the question: d_i = mean over seeds of correct[s][i] - baseline[i], tested with a one-sample
    t-test on the d_i and the matching t interval (they agree by construction). Summing discordant pairs across
    seeds into one McNemar test would treat the seeds' shared questions and shared baseline as independent
    evidence: a question the baseline got wrong by luck counts once per seed, and the evidence is overstated.
    With one seed this is the paired t-test, the large-sample counterpart of McNemar's test (`compare` is exact).
    """
    _check_alpha(alpha)
    if len(runs) == 0:
        raise StatsError("compare_seeds needs at least one seed's results, got none")
    b = np.asarray(baseline, dtype=bool)
    correct = np.stack([_paired(r, b)[0] for r in runs])  # (seeds, questions); each checked against the baseline
    ex = correct.mean(axis=1)
    test = paired_t(correct.mean(axis=0) - b, alpha)
    return {
        "n": int(b.size), "seeds": len(runs), "ex_seeds": [float(x) for x in ex], "ex_mean": float(ex.mean()),
        # between-seed spread; the sd is undefined (nan) for a single seed
        "ex_sd": float(ex.std(ddof=1)) if len(runs) > 1 else math.nan,
        "ex_min": float(ex.min()), "ex_max": float(ex.max()), "ex_b": float(b.mean()),
        "diff": test["mean"], "diff_ci_low": test["ci_low"], "diff_ci_high": test["ci_high"],
        "t": test["t"], "df": test["df"], "p": test["p"], "method": POOLED_METHOD,
        "verdict": _verdict(test["significant"], test["mean"]),
    }


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment, which keeps the chance of any false "significant" across the family at
    alpha: over the ascending p_(1..m), adjusted p_(i) = max over j <= i of min(1, (m - j + 1) p_(j)), in the
    input's order (statsmodels' `multipletests(method="holm")`). Compare the adjusted p with alpha."""
    from statsmodels.stats.multitest import multipletests

    p = np.asarray(pvalues, dtype=float)
    if p.ndim != 1 or np.any(~np.isfinite(p)) or np.any((p < 0) | (p > 1)):
        raise StatsError(f"p-values must be a 1-D sequence of numbers in [0, 1], got {list(pvalues)}")
    return [float(x) for x in multipletests(p, method="holm")[1]] if p.size else []


def worst_case_pairing(k_a: int, k_b: int, n: int) -> tuple[list[bool], list[bool]]:
    """Per-question results consistent with the counts that maximise disagreement (the least favourable
    pairing for detecting a difference): use when only aggregate counts were published."""
    _check_counts(k_a, n, "k_a")
    _check_counts(k_b, n, "k_b")
    both = max(0, k_a + k_b - n)
    only_a, only_b = k_a - both, k_b - both
    rest = n - both - only_a - only_b
    a = [True] * (both + only_a) + [False] * (only_b + rest)
    b = [True] * both + [False] * only_a + [True] * only_b + [False] * rest
    return a, b
