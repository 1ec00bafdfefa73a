"""Seeds as a random unit (slmsql.stats.seedstats), checked on simulated studies whose true method effect is known."""

import math
import warnings

import numpy as np
import pandas as pd
import pytest
from numpy.polynomial.hermite_e import hermegauss
from scipy.special import expit
from scipy.stats import t as student_t

from slmsql.errors import SlmsqlError
from slmsql.stats.seedstats import components, over_seeds, satterthwaite
from slmsql.stats.inference import compare_seeds


def true_effect(ability_sd: float, gain: float, seed_sd: float) -> float:
    """E over questions and seeds of P(trained right) - P(start right), by Gauss-Hermite quadrature: the
    method's effect the intervals should cover (logit model of `simulate`)."""
    x, w = hermegauss(80)
    w = w / w.sum()
    a = ability_sd * x
    return float(w @ (expit(a[:, None] + gain + seed_sd * x[None, :]) @ w) - w @ expit(a))


def simulate(reps, seeds, n, seed_sd, gain=0.3, ability_sd=1.5, rng_seed=0):
    """Per-question binary outcomes: question i has logit ability a_i ~ N(0, ability_sd); the start is right
    with probability expit(a_i), trained seed s with expit(a_i + gain + u_s), u_s ~ N(0, seed_sd) drawn per
    study: a known between-seed variance on the logit scale (0.3: seeds' EX differ by about 5 points, sd)."""
    rng = np.random.default_rng(rng_seed)
    a = rng.normal(0, ability_sd, (reps, 1, n))
    u = rng.normal(0, seed_sd, (reps, seeds, 1))
    base = rng.random((reps, n)) < expit(a[:, 0])
    runs = rng.random((reps, seeds, n)) < expit(a + gain + u)
    return runs, base


def coverage(reps, seeds, n, seed_sd):
    runs, base = simulate(reps, seeds, n, seed_sd)
    mu = true_effect(1.5, 0.3, seed_sd)
    method = [over_seeds(runs[i], base[i]) for i in range(reps)]
    pooled = [compare_seeds(list(runs[i]), base[i]) for i in range(reps)]
    covers = lambda r: r["diff_ci_low"] <= mu <= r["diff_ci_high"]  # noqa: E731
    return np.mean([covers(r) for r in method]), np.mean([covers(r) for r in pooled]), method, pooled


REPS = 3000
MC_TOL = 3 * math.sqrt(0.95 * 0.05 / REPS)  # 3 Monte Carlo standard errors of a 95% coverage: 0.012


@pytest.mark.parametrize("seeds,seed_sd,pooled_below", [(3, 0.3, 0.92), (5, 0.6, 0.87)])
def test_method_interval_covers_the_methods_effect(seeds, seed_sd, pooled_below):
    """With a known between-seed variance, the 95% interval over seeds covers the method's true effect in
    95% +- 3 Monte Carlo se of simulated studies; the pooled interval (questions the only random unit) does not:
    it speaks for the seeds drawn (observed 0.945 vs 0.895 at 3 seeds, 0.949 vs 0.842 at 5)."""
    method, pooled, *_ = coverage(REPS, seeds, 100, seed_sd)
    assert abs(method - 0.95) <= MC_TOL
    assert pooled < pooled_below


def test_zero_seed_variance_is_the_pooled_test():
    """No between-seed variance: wherever the seeds spread no more than their per-question noise explains
    (var_seed estimated 0, here ~63% of studies) the result is the pooled t-test's, to the bit; elsewhere it
    is wider (it adds a seed part that is there by chance), so the coverage is at least nominal."""
    method, pooled, m, p = coverage(REPS, 3, 100, 0.0)
    same = [i for i, r in enumerate(m) if not r["seed_part"]]
    assert 0.5 * REPS < len(same) < 0.75 * REPS
    for i in same:
        assert (m[i]["diff_ci_low"], m[i]["diff_ci_high"], m[i]["p"]) == (
            p[i]["diff_ci_low"], p[i]["diff_ci_high"], p[i]["p"])
        assert m[i]["df"] == p[i]["df"] == 99
    for i in set(range(REPS)) - set(same):
        assert m[i]["diff_ci_high"] - m[i]["diff_ci_low"] > p[i]["diff_ci_high"] - p[i]["diff_ci_low"]
    assert abs(pooled - 0.95) <= MC_TOL and method >= 0.95 - MC_TOL


def test_identical_seeds_equal_the_pooled_test():
    runs, base = simulate(1, 3, 80, 0.0, rng_seed=4)
    same = [runs[0, 0]] * 3
    m, p = over_seeds(same, base[0]), compare_seeds(same, base[0])
    assert not m["seed_part"] and m["var_seed"] == m["var_within"] == 0
    assert (m["diff"], m["diff_ci_low"], m["diff_ci_high"], m["p"]) == (p["diff"], p["diff_ci_low"],
                                                                        p["diff_ci_high"], p["p"])


def test_components_match_statsmodels_crossed_reml():
    """statsmodels' MixedLM, seed and question as crossed random effects (REML), estimates the same variance
    components on a balanced array (where none is truncated), and the same standard error of the mean."""
    runs, base = simulate(1, 3, 30, 0.6, rng_seed=3)
    d = runs[0].astype(float) - base[0]
    c = components(d)
    assert c["var_seed"] > 0 and c["var_question"] > 0
    frame = pd.DataFrame({"d": d.ravel(), "seed": np.repeat(range(3), 30), "q": np.tile(range(30), 3), "g": 1})
    import statsmodels.formula.api as smf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # convergence chatter of the iterative fit
        fit = smf.mixedlm("d ~ 1", frame, groups="g", re_formula="0",
                          vc_formula={"q": "0 + C(q)", "seed": "0 + C(seed)"}).fit(reml=True)
    var_q, var_seed = fit.vcomp  # vc_formula's names in sorted order
    assert (c["var_question"], c["var_seed"], c["var_within"]) == pytest.approx((var_q, var_seed, fit.scale),
                                                                                rel=1e-3)
    r = over_seeds(runs[0], base[0])
    se = (r["diff_ci_high"] - r["diff_ci_low"]) / 2 / student_t.ppf(0.975, r["df"])
    assert se == pytest.approx(float(fit.bse_fe.iloc[0]), rel=1e-3)
    assert r["diff"] == pytest.approx(float(fit.fe_params.iloc[0]))


def test_satterthwaite_textbook_forms():
    """One mean square: its own df. Two equal ones of df 10: 20 (the pooled variance). Welch's df for
    s1^2 = 4, n1 = 10, s2^2 = 9, n2 = 15: (0.4 + 0.6)^2 / (0.4^2 / 9 + 0.6^2 / 14) = 23.0 (to 1 decimal)."""
    assert satterthwaite([(1, 3.0, 7)]) == pytest.approx(7)
    assert satterthwaite([(1, 2.0, 10), (1, 2.0, 10)]) == pytest.approx(20)
    assert satterthwaite([(1 / 10, 4.0, 9), (1 / 15, 9.0, 14)]) == pytest.approx(1 / (0.16 / 9 + 0.36 / 14))
    assert round(satterthwaite([(1 / 10, 4.0, 9), (1 / 15, 9.0, 14)]), 1) == 23.0


@pytest.mark.parametrize("runs,base", [([[True, False]], [True, False]), ([[True], [False]], [True]),
                                       ([[True, False, True]], [True, False])])
def test_bad_input_raises(runs, base):
    with pytest.raises(ValueError) as e:
        over_seeds(runs, base)
    assert isinstance(e.value, SlmsqlError)
