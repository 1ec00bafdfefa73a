"""Sizing by power (slmsql.power): textbook t-test values, McNemar's exact power, and simulated studies."""

import math

import numpy as np
import pytest
from scipy.stats import binom
from statsmodels.stats.power import TTestPower
from test_seeds import simulate, true_effect

from slmsql.errors import SlmsqlError
from slmsql.power import Components, mdd, power, questions_needed
from slmsql.seeds import components, over_seeds
from slmsql.stats import compare_seeds


def test_pooled_power_is_the_textbook_t_test():
    """G*Power / Cohen (1988), one-sample (paired) t-test, d = 0.5, two-sided alpha 0.05: n = 34 for power 0.80
    (actual 0.8078), n = 54 for 0.95 (actual 0.9502); and statsmodels' TTestPower at alpha / family."""
    unit = Components(var_question=1.0)
    assert questions_needed(0.5, unit, seeds=1, target=0.8) == 34
    assert questions_needed(0.5, unit, seeds=1, target=0.95) == 54
    assert power(0.5, unit, 1, 34) == pytest.approx(0.8078, abs=5e-5)
    c = Components(var_question=0.12, var_within=0.09)  # 3 seeds: Var(mean over seeds - baseline) = 0.15
    for n, family in [(86, 1), (86, 6), (200, 4)]:
        ref = TTestPower().power(0.05 / math.sqrt(0.15), n, 0.05 / family)
        assert power(0.05, c, 3, n, family) == pytest.approx(ref, rel=1e-9)
    assert mdd(c, 3, 200, 4, target=0.9) == pytest.approx(
        TTestPower().solve_power(None, 200, 0.05 / 4, 0.9) * math.sqrt(0.15), rel=1e-5)


def exact_mcnemar_power(n, psi, delta, alpha=0.05):
    """Power of McNemar's exact test by summing over the discordant counts (independent of the t model)."""
    total = 0.0
    for m in range(1, n + 1):
        ks = np.arange(m + 1)
        p = np.minimum(1.0, 2 * binom.cdf(np.minimum(ks, m - ks), m, 0.5))
        total += binom.pmf(m, n, psi) * binom.pmf(ks[p <= alpha], m, (psi + delta) / (2 * psi)).sum()
    return total


@pytest.mark.parametrize("psi,delta", [(0.2, 0.1), (0.3, 0.08)])
def test_one_seed_plan_has_mcnemars_power(psi, delta):
    """One seed known by its discordance: the size the plan gives has ~90% power under McNemar's exact test,
    the textbook test for paired binary outcomes (Connor 1987's approximate n is within a few questions)."""
    n = questions_needed(delta, Components.from_discordance(psi, delta), seeds=1)
    connor = (1.959964 * math.sqrt(psi) + 1.281552 * math.sqrt(psi - delta ** 2)) ** 2 / delta ** 2
    assert abs(n - connor) / connor < 0.05
    assert exact_mcnemar_power(n, psi, delta) == pytest.approx(0.9, abs=0.03)


def pilot(seed_sd):
    """A large simulated pilot (200 seeds x 3000 questions): its components are the truth's to ~5%."""
    runs, base = simulate(1, 200, 3000, seed_sd, gain=0.5, rng_seed=11)
    c = components(runs[0].astype(float) - base[0])
    return Components(c["var_question"], c["var_within"], c["var_seed"]), true_effect(1.5, 0.5, seed_sd)


@pytest.mark.parametrize("seed_sd,seeds,family,tol", [(0.0, 3, 6, 0.037), (0.0, 5, 1, 0.037), (0.15, 5, 1, 0.05)])
def test_planned_designs_have_their_power_in_simulated_studies(seed_sd, seeds, family, tol):
    """The design the plan sizes for 90% power rejects in 90% of simulated binary studies: within 3 Monte Carlo
    se of 600 studies (0.037) with no seed variance; with a 2.6-point between-seed sd, within 0.05 (observed
    0.88: the normal-theory model of the seed part is a little optimistic). A noncentral t at the expected mean
    squares' df predicts 0.90 where 0.84 is simulated (3 seeds, family 6)."""
    comp, effect = pilot(seed_sd)
    n = questions_needed(effect, comp, seeds, family, over_seeds=True)
    reps, level = 600, 0.05 / family
    runs, base = simulate(reps, seeds, n, seed_sd, gain=0.5, rng_seed=12)
    hits = np.mean([over_seeds(runs[i], base[i], alpha=level)["p"] < level for i in range(reps)])
    assert hits == pytest.approx(0.9, abs=tol)
    if seed_sd == 0:  # and the pooled test's predicted power too (seeds add nothing to it here)
        pooled = np.mean([compare_seeds(list(runs[i]), base[i], alpha=level)["p"] < level for i in range(reps)])
        assert pooled == pytest.approx(power(effect, comp, seeds, n, family), abs=0.04)


def test_seed_variance_bounds_what_questions_can_buy():
    """With seeds random, var_seed / S is a floor under the se: a 3-point gain with a 5-point between-seed sd
    needs more seeds, not more questions. The pooled test (these seeds) does not see that floor."""
    c = Components(var_question=0.15, var_within=0.15, var_seed=0.05 ** 2)
    assert questions_needed(0.03, c, 3, over_seeds=True) is None
    assert questions_needed(0.03, c, 3) is not None
    assert mdd(c, 3, 20_000, over_seeds=True) > 0.1
    more = [mdd(c, s, 300, over_seeds=True) for s in (3, 5, 10)]
    assert more[0] > more[1] > more[2]
    d = mdd(c, 10, 300, family=4, over_seeds=True)
    assert power(d, c, 10, 300, 4, over_seeds=True) == pytest.approx(0.9, abs=0.002)
    assert mdd(c, 10, 300, family=8, over_seeds=True) > d  # a bigger family, a bigger MDD


@pytest.mark.parametrize("call", [
    lambda: Components(-0.1), lambda: Components.from_discordance(0.1, 0.2),
    lambda: power(0.1, Components(0.1), 3, 100, over_seeds=True), lambda: power(0.1, Components(0.1, 0, 0.01), 1, 100,
                                                                                 over_seeds=True),
    lambda: power(0.1, Components(0.1), 3, 100, family=0), lambda: mdd(Components(0.1), 3, 100, target=1.0)])
def test_bad_input_raises(call):
    with pytest.raises(ValueError) as e:
        call()
    assert isinstance(e.value, SlmsqlError)
