"""Sizing a study by power: from a pilot's variance components, the minimum detectable difference (MDD) of a
design (seeds x questions, Holm family, alpha) and the designs that reach a target power at a given effect.

A comparison's test is a t-test on the mean per-question difference (`stats.compare_seeds`, questions the
random unit: a verdict for the seeds trained) or the same mean with seeds random too (`seedstats.over_seeds`: a
verdict for the method). With the pilot's components var_seed, var_question, var_within (`seedstats.components`),
a design of S seeds and n questions has

    pooled:  se^2 = (var_question + var_within / S) / n,                 df = n - 1
    method:  se^2 = var_seed / S + (var_question + var_within / S) / n,  df = S - 1 (stats/seedstats.py: the
             t-test on the per-seed mean differences with the questions' variance added)

and the power of the two-sided test at level alpha / m is that of a noncentral t with noncentrality
effect / se (the one-sample t-test's power, as G*Power and statsmodels' TTestPower compute it, with these se
and df). Holm over a family of m rejects a comparison at its first step when p < alpha / m: planning at
alpha / m (Bonferroni) is a lower bound on Holm's power for each comparison. The components are taken as the
pilot measured them, at the pilot's effect: the MDD holds the variances fixed as the effect changes.

Degenerate cases are answered, not failed on: a pilot whose differences have no variance (GRPO changed no
answer) has se 0, so any gain > 0 is detected (an MDD of 0); an effect of 0 is detected by no design (its power
is the level); a target power at or below the level alpha / m is refused (every gain exceeds it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.stats import chi2, nct, norm
from scipy.stats import t as student_t

from slmsql.stats.inference import StatsError


@dataclass(frozen=True)
class Components:
    """Variances of a per-question difference (seedstats.components); var_seed None where the pilot had 1 seed."""
    var_question: float
    var_within: float = 0.0
    var_seed: float | None = None

    def __post_init__(self):
        for name in ("var_question", "var_within", "var_seed"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise StatsError(f"{name} must be a finite variance >= 0, got {v}")

    @classmethod
    def from_discordance(cls, discordance: float, effect: float, seed_sd: float | None = None) -> "Components":
        """A one-seed pilot known by its counts: d_i in {-1, 0, 1} has variance psi - effect^2, psi the share of
        questions where the runs disagree. All of it is taken as question variance (var_within 0): more seeds
        then do not shrink it, the pessimistic reading of one seed. `seed_sd`: the between-seed sd of the EX
        difference, from elsewhere (it cannot come from one seed)."""
        if not 0 <= abs(effect) <= discordance <= 1:
            raise StatsError(f"need 0 <= |effect| <= discordance <= 1, got effect={effect}, discordance={discordance}")
        return cls(discordance - effect ** 2, 0.0, None if seed_sd is None else seed_sd ** 2)


def se_df(c: Components, seeds: int, n: int, over_seeds: bool) -> tuple[float, float]:
    """Standard error of the mean difference and the t reference's df for a design (module docstring)."""
    if seeds < 1 or n < 2:
        raise StatsError(f"a design needs at least 1 seed and 2 questions, got seeds={seeds}, n={n}")
    pooled = (c.var_question + c.var_within / seeds) / n
    if not over_seeds:
        return math.sqrt(pooled), n - 1
    if c.var_seed is None:
        raise StatsError("the method's power needs the between-seed variance: a pilot of at least 2 seeds, or "
                         "--seed-sd")
    if seeds < 2:
        raise StatsError("the method's test needs at least 2 seeds")
    return math.sqrt(pooled + c.var_seed / seeds), seeds - 1


def power(effect: float, c: Components, seeds: int, n: int, family: int = 1, alpha: float = 0.05,
          over_seeds: bool = False) -> float:
    """Probability that the two-sided test at alpha / family rejects when the true mean difference is `effect`."""
    if family < 1 or not 0 < alpha < 1:
        raise StatsError(f"need family >= 1 and 0 < alpha < 1, got family={family}, alpha={alpha}")
    se, df = se_df(c, seeds, n, over_seeds)
    if se == 0:
        return float(effect != 0)
    if over_seeds:
        return _method_power(effect, c, seeds, n, alpha / family)
    crit = float(student_t.ppf(1 - alpha / (2 * family), df))
    ncp = effect / se
    p = float(nct.sf(crit, df, ncp) + nct.cdf(-crit, df, ncp))
    # scipy's noncentral t returns nan far in its tail (ncp ~ 40 at df 3000); there the normal limit is exact
    # to many digits
    return p if math.isfinite(p) else float(norm.sf(crit - ncp) + norm.cdf(-crit - ncp))


DRAWS = 20_000  # Monte Carlo error of a power near 0.9: 0.002


def _method_power(effect: float, c: Components, seeds: int, n: int, level: float) -> float:
    """The method test's power by simulating its own statistics under the normal-theory model: the three mean
    squares as scaled chi-squares around their expectations, the grand mean normal around `effect`, and the test
    as `seedstats.over_seeds` runs it (MS_seed plus the question part MS_question - MS_within where positive, t on
    seeds - 1 df). A noncentral t at the expected mean squares misses the test's estimated variance, which is not a
    scaled chi-square. Fixed draws (seeded), so power is a smooth function of the effect and the same on every
    call."""
    rng = np.random.default_rng(0)
    dfs = np.array([seeds - 1, n - 1, (seeds - 1) * (n - 1)], dtype=float)
    expected = np.array([n * c.var_seed + c.var_within, seeds * c.var_question + c.var_within, c.var_within])
    ms = expected[:, None] * rng.chisquare(dfs[:, None], (3, DRAWS)) / dfs[:, None]
    mean = effect + math.sqrt((expected[0] + expected[1] - expected[2]) / (seeds * n)) * rng.standard_normal(DRAWS)
    combo = ms[0] + np.maximum(ms[1] - ms[2], 0.0)
    crit = student_t.ppf(1 - level / 2, seeds - 1)
    return float(np.mean(np.abs(mean) > crit * np.sqrt(combo / (seeds * n))))


def check_target(target: float, family: int = 1, alpha: float = 0.05) -> None:
    """A target power the test can mean: above its level alpha / family (its power at no effect at all, which
    every gain > 0 exceeds) and below 1 (which no finite study reaches)."""
    level = alpha / family
    if not 0 < target < 1:
        raise StatsError(f"power must lie strictly between 0 and 1, got {target}")
    if target <= level:
        raise StatsError(f"power {target:g} is at or below the test's level alpha / family = {alpha:g} / {family} "
                         f"= {level:.4g}, the power at no effect at all: every gain would 'reach' it. Give a power "
                         f"above {level:.4g} (0.8 or 0.9 is usual)")


TINY = 1e-9  # the smallest gain mdd looks at: an MDD of 0 means every gain above it reaches the target


def mdd(c: Components, seeds: int, n: int, family: int = 1, alpha: float = 0.05, target: float = 0.9,
        over_seeds: bool = False) -> float:
    """The smallest gain (EX difference) detected with power `target`; inf when no gain up to 1 (every
    question turned right) is; 0 when any gain > 0 is (a pilot whose differences have no variance: it changed
    no answer, or every seed changed the same ones the same way)."""
    check_target(target, family, alpha)
    se, _ = se_df(c, seeds, n, over_seeds)
    if se == 0:
        return 0.0
    gap = lambda d: power(d, c, seeds, n, family, alpha, over_seeds) - target  # noqa: E731
    if gap(1.0) < 0:
        return math.inf
    if gap(TINY) >= 0:  # a variance so small that the least gain already reaches the target
        return 0.0
    return float(brentq(gap, TINY, 1.0, xtol=1e-7))


def questions_needed(effect: float, c: Components, seeds: int, family: int = 1, alpha: float = 0.05,
                     target: float = 0.9, over_seeds: bool = False, max_n: int = 20_000) -> int | float | None:
    """The fewest questions that give `seeds` seeds power `target` at `effect`; None if more than max_n
    (with seeds random, var_seed / S bounds the se from below: past some point more questions do not help);
    inf at an effect of 0, which no design detects (its power is the test's level, below any target)."""
    check_target(target, family, alpha)
    if effect == 0:
        return math.inf
    ok = lambda n: power(effect, c, seeds, n, family, alpha, over_seeds) >= target  # noqa: E731
    if not ok(max_n):
        return None
    lo, hi = 2, max_n  # power grows with n: bisect for the first n that reaches the target
    if ok(lo):
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def seed_variance_interval(seeds: int, confidence: float = 0.95) -> tuple[float, float]:
    """How far the true between-seed variance may lie from a pilot's estimate: the chi-square interval of a
    variance estimated with seeds - 1 degrees of freedom (its mean square MS_seed has seeds - 1), as multiples of
    the estimate. 2 seeds (1 df): 0.20 to 1018 times."""
    df = seeds - 1
    if df < 1:
        raise StatsError(f"a between-seed variance needs at least 2 seeds, got {seeds}")
    tail = (1 - confidence) / 2
    return df / float(chi2.ppf(1 - tail, df)), df / float(chi2.ppf(tail, df))


def plan(c: Components, effect: float, n: int, seeds: int, family: int, alpha: float = 0.05, target: float = 0.9,
         max_seeds: int = 8, max_n: int = 2000) -> dict:
    """One comparison's plan: the design's power at `effect` and its MDD, for the seeds trained (pooled) and for
    the method (seeds random; None without a between-seed variance or with 1 seed), and for 1..max_seeds seeds
    the questions needed for `target` power at `effect` (None: more than max_n)."""
    check_target(target, family, alpha)

    def both(fn, s):
        method = fn(True) if c.var_seed is not None and s >= 2 else None
        return fn(False), method

    p_pooled, p_method = both(lambda o: power(effect, c, seeds, n, family, alpha, o), seeds)
    m_pooled, m_method = both(lambda o: mdd(c, seeds, n, family, alpha, target, o), seeds)
    sizes = []
    for s in range(1, max_seeds + 1):
        pooled, method = both(lambda o: questions_needed(effect, c, s, family, alpha, target, o, max_n), s)
        sizes.append({"seeds": s, "n_pooled": pooled, "n_method": method})
    return {"effect": effect, "seeds": seeds, "n": n, "family": family, "alpha": alpha, "target": target,
            "max_n": max_n,
            "power_pooled": p_pooled, "power_method": p_method, "mdd_pooled": m_pooled, "mdd_method": m_method,
            "components": {"var_question": c.var_question, "var_within": c.var_within, "var_seed": c.var_seed},
            "sizes": sizes}
