"""Statistics for execution accuracy (EX): what a difference between two runs on the same questions supports.

Runs are compared *paired* (same questions), so the test is McNemar's on the discordant pairs and the
interval is a paired bootstrap. Per-run accuracy gets a Wilson interval, which behaves at small n and near 0/1.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from scipy.optimize import brentq
from scipy.stats import norm
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.proportion import proportion_confint

from slmsql.errors import SlmsqlError


class StatsError(SlmsqlError, ValueError):
    """Input that no statistic can be computed from (empty, mismatched, counts out of range)."""


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


def mcnemar_exact(only_a: int, only_b: int) -> float:
    if only_a < 0 or only_b < 0:
        raise StatsError(f"discordant counts must be >= 0, got only_a={only_a}, only_b={only_b}")
    if only_a + only_b == 0:
        return 1.0  # the runs agree on every question: no evidence of any difference
    return float(mcnemar([[0, only_a], [only_b, 0]], exact=True).pvalue)


def paired_bootstrap(a, b, n_boot: int = 10_000, seed: int = 0, confidence: float = 0.95) -> tuple[float, float]:
    """Percentile CI of mean(a) - mean(b), resampling questions (pairs) jointly.

    Per-question differences take only the values +1 (only_a), -1 (only_b) and 0, so resampling n pairs
    is exactly a multinomial draw of those three counts: O(n_boot) instead of an n_boot x n index matrix.
    """
    t = paired_table(a, b)
    n = sum(t.values())
    p = np.array([t["only_a"], t["only_b"], t["both_right"] + t["both_wrong"]]) / n
    counts = np.random.default_rng(seed).multinomial(n, p, size=n_boot)
    diffs = (counts[:, 0] - counts[:, 1]) / n
    tail = 100 * (1 - confidence) / 2
    lo, hi = np.percentile(diffs, [tail, 100 - tail])
    return float(lo), float(hi)


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


def verdict(p_value: float, diff: float, alpha: float = 0.05) -> str:
    if p_value < alpha and diff != 0:
        return "improved" if diff > 0 else "regressed"
    return "no significant difference"


def compare(a: Sequence[bool], b: Sequence[bool], alpha: float = 0.05, n_boot: int = 10_000, seed: int = 0) -> dict:
    """Run `a` vs baseline `b` on the same questions, as a flat dict of numbers (MLflow metrics) plus `verdict`."""
    t = paired_table(a, b)
    n = sum(t.values())
    k_a, k_b = t["both_right"] + t["only_a"], t["both_right"] + t["only_b"]
    conf = 1 - alpha
    (a_lo, a_hi), (b_lo, b_hi) = wilson(k_a, n, conf), wilson(k_b, n, conf)
    d_lo, d_hi = paired_bootstrap(a, b, n_boot=n_boot, seed=seed, confidence=conf)
    p = mcnemar_exact(t["only_a"], t["only_b"])
    disc = (t["only_a"] + t["only_b"]) / n
    diff = (k_a - k_b) / n
    return {
        "n": n, "ex_a": k_a / n, "ex_b": k_b / n,
        "ex_a_ci_low": a_lo, "ex_a_ci_high": a_hi, "ex_b_ci_low": b_lo, "ex_b_ci_high": b_hi,
        "diff": diff, "diff_ci_low": d_lo, "diff_ci_high": d_hi, **t, "mcnemar_p": p,
        # observed discordance when there is any; with none, fall back to the independence assumption
        "mdd": min_detectable_difference(n, k_b / n, disc or None, alpha=alpha),
        "verdict": verdict(p, diff, alpha),
    }


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
