import math

import numpy as np
import pytest
from scipy.stats import binom

from slmsql.errors import SlmsqlError
from slmsql.stats import (compare, mcnemar_exact, min_detectable_difference, paired_bootstrap, paired_table,
                          verdict, wilson, worst_case_pairing)


def wilson_formula(k, n, z=1.959963984540054):
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


@pytest.mark.parametrize("k,n", [(0, 10), (7, 10), (10, 10), (55, 149), (164, 200)])
def test_wilson_matches_formula(k, n):
    assert wilson(k, n) == pytest.approx(wilson_formula(k, n), abs=1e-9)


def test_mcnemar_exact_known_table():
    assert mcnemar_exact(10, 2) == pytest.approx(2 * binom.cdf(2, 12, 0.5))
    assert mcnemar_exact(2, 10) == pytest.approx(2 * binom.cdf(2, 12, 0.5))
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 5) == 1.0


def test_paired_table_and_worst_case_pairing():
    assert paired_table([1, 1, 0, 0, 1], [1, 0, 1, 0, 0]) == {
        "both_right": 1, "only_a": 2, "only_b": 1, "both_wrong": 1}
    a, b = worst_case_pairing(55, 54, 149)  # fits without overlap: nobody right on both
    assert (sum(a), sum(b), len(a)) == (55, 54, 149)
    assert paired_table(a, b) == {"both_right": 0, "only_a": 55, "only_b": 54, "both_wrong": 40}
    a, b = worst_case_pairing(164, 166, 200)  # 330 > 200: at least 130 must overlap
    assert paired_table(a, b) == {"both_right": 130, "only_a": 34, "only_b": 36, "both_wrong": 0}


def test_bootstrap_identical_inputs_and_seed():
    a = [True, False, True, True, False] * 20
    assert paired_bootstrap(a, a) == (0.0, 0.0)
    b = [True, True, False, False, False] * 20
    ci = paired_bootstrap(a, b, n_boot=2000, seed=3)
    assert ci == paired_bootstrap(a, b, n_boot=2000, seed=3)
    assert ci != paired_bootstrap(a, b, n_boot=2000, seed=4)
    assert ci[0] < 0.2 < ci[1]  # true diff 0.6 - 0.4


def test_bootstrap_matches_index_resampling():
    """The multinomial shortcut must agree with resampling question indices directly."""
    rng = np.random.default_rng(1)
    a, b = rng.random(300) < 0.6, rng.random(300) < 0.5
    d = a.astype(int) - b.astype(int)
    boots = d[rng.integers(0, 300, (4000, 300))].mean(axis=1)
    assert paired_bootstrap(a, b, n_boot=4000) == pytest.approx(tuple(np.percentile(boots, [2.5, 97.5])), abs=0.01)


def test_verdicts():
    assert verdict(0.01, 0.05) == "improved"
    assert verdict(0.01, -0.05) == "regressed"
    assert verdict(0.5, 0.05) == "no significant difference"
    assert verdict(0.05, 0.05) == "no significant difference"
    better = [True] * 80 + [False] * 20
    worse = [True] * 50 + [False] * 50
    assert compare(better, worse, n_boot=500)["verdict"] == "improved"
    assert compare(worse, better, n_boot=500)["verdict"] == "regressed"
    tie = compare(better, better, n_boot=500)
    assert (tie["verdict"], tie["mcnemar_p"], tie["diff_ci_low"], tie["diff_ci_high"]) == (
        "no significant difference", 1.0, 0.0, 0.0)


@pytest.mark.parametrize("name,k_a,k_b,n,half", [("bird", 55, 54, 149, 0.077), ("spider", 164, 166, 200, 0.053)])
def test_seed_experiment_is_noise(name, k_a, k_b, n, half):
    """The published card called SFT vs GRPO 'within ~4% noise' without computing it. It is noise, but the
    95% Wilson half-widths are ~7.7 (BIRD) and ~5.3 (Spider) points, not 4."""
    r = compare(*worst_case_pairing(k_a, k_b, n))
    assert r["verdict"] == "no significant difference"
    assert r["mcnemar_p"] > 0.5
    assert r["diff_ci_low"] < 0 < r["diff_ci_high"]
    for run in ("a", "b"):
        assert (r[f"ex_{run}_ci_high"] - r[f"ex_{run}_ci_low"]) / 2 == pytest.approx(half, abs=0.002)
    assert r["mdd"] > 0.04  # neither slice could have detected a 4-point change
    assert all(isinstance(v, (int, float, str)) for v in r.values())


def exact_mcnemar_power(n, psi, delta, alpha=0.05):
    """Power of the exact McNemar test, computed by summing over discordant counts (independent of Connor)."""
    power = 0.0
    for m in range(1, n + 1):
        ks = np.arange(m + 1)
        p = np.minimum(1.0, 2 * binom.cdf(np.minimum(ks, m - ks), m, 0.5))
        power += binom.pmf(m, n, psi) * binom.pmf(ks[p <= alpha], m, (psi + delta) / (2 * psi)).sum()
    return power


def test_mdd_has_the_stated_power():
    d = min_detectable_difference(200, 0.8, discordance=0.2)
    assert 0.03 < d < 0.1
    assert 0.7 < exact_mcnemar_power(200, 0.2, d) < 0.85  # exact test is a little conservative
    assert min_detectable_difference(800, 0.8, 0.2) < d  # more data, smaller MDD
    assert min_detectable_difference(200, 0.8, 0.1) < d  # runs that agree more, smaller MDD
    assert min_detectable_difference(200, 0.5) > min_detectable_difference(200, 0.5, 0.2)
    assert min_detectable_difference(5, 0.5, 0.01) == math.inf


@pytest.mark.parametrize("call", [
    lambda: wilson(0, 0), lambda: wilson(5, 4), lambda: paired_table([], []),
    lambda: paired_table([True], [True, False]), lambda: compare([True, False], [True]),
    lambda: worst_case_pairing(3, 1, 2), lambda: min_detectable_difference(0, 0.5)])
def test_bad_input_raises(call):
    with pytest.raises(ValueError) as e:
        call()
    assert isinstance(e.value, SlmsqlError)
