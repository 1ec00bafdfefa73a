import math

import numpy as np
import pytest
from scipy.stats import beta, binom, ttest_1samp
from scipy.stats import t as student_t
from statsmodels.stats.contingency_tables import mcnemar

from slmsql.errors import SlmsqlError
from slmsql.stats.inference import (
    DIFF_CI_METHOD, compare, compare_seeds, exact_paired, mcnemar_exact, min_detectable_difference, paired_t,
    paired_table, verdict, wilson, worst_case_pairing
)


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
    for only_a, only_b in [(0, 1), (3, 11), (34, 36), (55, 54), (40, 12), (200, 170)]:  # statsmodels agrees
        assert mcnemar_exact(only_a, only_b) == pytest.approx(
            mcnemar([[0, only_a], [only_b, 0]], exact=True).pvalue, rel=1e-12)


def test_paired_table_and_worst_case_pairing():
    assert paired_table([1, 1, 0, 0, 1], [1, 0, 1, 0, 0]) == {
        "both_right": 1, "only_a": 2, "only_b": 1, "both_wrong": 1}
    a, b = worst_case_pairing(55, 54, 149)  # fits without overlap: nobody right on both
    assert (sum(a), sum(b), len(a)) == (55, 54, 149)
    assert paired_table(a, b) == {"both_right": 0, "only_a": 55, "only_b": 54, "both_wrong": 40}
    a, b = worst_case_pairing(164, 166, 200)  # 330 > 200: at least 130 must overlap
    assert paired_table(a, b) == {"both_right": 130, "only_a": 34, "only_b": 36, "both_wrong": 0}


def test_verdicts():
    assert verdict(0.01, 0.05) == "improved"
    assert verdict(0.01, -0.05) == "regressed"
    assert verdict(0.5, 0.05) == "no significant difference"
    assert verdict(0.05, 0.05) == "no significant difference"
    better = [True] * 80 + [False] * 20
    worse = [True] * 50 + [False] * 50
    assert compare(better, worse)["verdict"] == "improved"
    assert compare(worse, better)["verdict"] == "regressed"
    tie = compare(better, better)
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


def pairs(both_right, only_a, only_b, both_wrong):
    a = [True] * both_right + [True] * only_a + [False] * only_b + [False] * both_wrong
    b = [True] * both_right + [False] * only_a + [True] * only_b + [False] * both_wrong
    return a, b


def cp_diff_interval(only_a, only_b, n, alpha):
    """Clopper-Pearson from beta quantiles (independent of statsmodels), mapped to the EX difference."""
    n_d = only_a + only_b
    lo = beta.ppf(alpha / 2, only_a, n_d - only_a + 1) if only_a > 0 else 0.0
    hi = beta.ppf(1 - alpha / 2, only_a + 1, n_d - only_a) if only_a < n_d else 1.0
    return n_d / n * (2 * lo - 1), n_d / n * (2 * hi - 1)


def test_toy_dev_case_interval_agrees_with_mcnemar():
    """3 vs 11 discordant of 200: the bootstrap interval [-8.0, -0.5] excluded 0 while p = 0.057 did not reject."""
    r = compare(*pairs(150, 3, 11, 36))
    assert r["mcnemar_p"] == 940 / 16384  # 2 * (1 + 14 + 91 + 364) / 2**14, exactly
    lo, hi = 14 / 200 * (2 * beta.ppf(0.025, 3, 12) - 1), 14 / 200 * (2 * beta.ppf(0.975, 4, 11) - 1)
    assert (r["diff_ci_low"], r["diff_ci_high"]) == pytest.approx((lo, hi), abs=1e-12)
    assert r["diff_ci_low"] < r["diff"] == -0.04 < 0 < r["diff_ci_high"]
    assert r["verdict"] == "no significant difference"
    assert r["diff_ci_method"] == DIFF_CI_METHOD and "Clopper-Pearson" in DIFF_CI_METHOD


@pytest.mark.parametrize("alpha", [0.05, 0.01, 0.1])
def test_interval_excludes_zero_exactly_when_mcnemar_rejects(alpha):
    for only_a in range(26):
        for only_b in range(26):
            n = only_a + only_b + 7
            p = min(1.0, 2 * binom.cdf(min(only_a, only_b), only_a + only_b, 0.5)) if only_a + only_b else 1.0
            lo, hi = cp_diff_interval(only_a, only_b, n, alpha) if only_a + only_b else (0.0, 0.0)
            if abs(p - alpha) > 1e-12:  # the claim, checked on the independent computation
                assert (lo > 0 or hi < 0) == (p < alpha), (only_a, only_b)
            r = exact_paired(only_a, only_b, n, alpha)
            assert r["p"] == pytest.approx(p, rel=1e-12)
            assert (r["diff_ci_low"], r["diff_ci_high"]) == pytest.approx((lo, hi), abs=1e-12)
            assert (r["diff_ci_low"] > 0 or r["diff_ci_high"] < 0) == r["significant"] == (r["p"] < alpha)


@pytest.mark.parametrize("only_a,only_b,alpha", [
    (5, 0, 1 / 16), (0, 5, 1 / 16), (9, 1, 11 / 512), (1, 9, 11 / 512),
    # here beta quantiles land 1e-16..3e-15 beyond 1/2: rounding alone would exclude 0 at p == alpha
    (11, 3, 940 / 16384), (3, 11, 940 / 16384), (13, 4, 3214 / 65536), (7, 2, 92 / 512)])
def test_boundary_p_equal_to_alpha(only_a, only_b, alpha):
    """At p == alpha exactly (a dyadic alpha) the Clopper-Pearson bound is exactly 1/2: the closed interval
    touches 0 and the test does not reject (p < alpha is required). One more discordant pair on the same side
    lowers p and rejects."""
    n = 40
    assert mcnemar_exact(only_a, only_b) == alpha
    a, b = pairs(20, only_a, only_b, n - 20 - only_a - only_b)
    r = compare(a, b, alpha=alpha)
    assert r["verdict"] == "no significant difference"
    assert r["diff_ci_low"] <= 0 <= r["diff_ci_high"]
    assert min(abs(r["diff_ci_low"]), abs(r["diff_ci_high"])) == pytest.approx(0, abs=1e-12)
    more = (only_a + (only_a > only_b), only_b + (only_b > only_a))
    r = compare(*pairs(20, *more, n - 20 - sum(more)), alpha=alpha)
    assert r["mcnemar_p"] < alpha and r["verdict"] == ("improved" if only_a > only_b else "regressed")
    assert r["diff_ci_low"] > 0 or r["diff_ci_high"] < 0


def test_readme_headline_statistics():
    """README: from the counts alone (worst-case pairing) McNemar p = 1.0 (BIRD) and 0.91 (Spider); at n = 149 a
    paired test cannot detect differences below ~16-20 points (independent errors ... worst-case discordance)."""
    bird = compare(*worst_case_pairing(55, 54, 149))
    assert bird["mcnemar_p"] == 1.0
    spider = compare(*worst_case_pairing(164, 166, 200))
    assert spider["mcnemar_p"] == pytest.approx(2 * binom.cdf(34, 70, 0.5), rel=1e-12)
    assert round(spider["mcnemar_p"], 3) == 0.905
    assert bird["mdd"] == pytest.approx(0.195, abs=0.0005)  # discordance 109/149
    assert min_detectable_difference(149, 54 / 149) == pytest.approx(0.162, abs=0.0005)  # independent errors
    for r, (only_a, only_b, n) in ((bird, (55, 54, 149)), (spider, (34, 36, 200))):
        ci = cp_diff_interval(only_a, only_b, n, 0.05)
        assert (r["diff_ci_low"], r["diff_ci_high"]) == pytest.approx(ci, abs=1e-12)


def test_alpha_001_flips_a_verdict():
    a, b = pairs(150, 12, 3, 35)  # p = 2 * (1 + 15 + 105 + 455) / 2**15 = 0.0352
    assert mcnemar_exact(12, 3) == 1152 / 32768
    at_05, at_01 = compare(a, b, alpha=0.05), compare(a, b, alpha=0.01)
    assert at_05["verdict"] == "improved" and at_05["diff_ci_low"] > 0
    assert at_01["verdict"] == "no significant difference" and at_01["diff_ci_low"] < 0 < at_01["diff_ci_high"]
    assert (at_01["diff_ci_low"], at_01["diff_ci_high"]) == pytest.approx(cp_diff_interval(12, 3, 200, 0.01))
    assert at_01["ex_a_ci_high"] - at_01["ex_a_ci_low"] > at_05["ex_a_ci_high"] - at_05["ex_a_ci_low"]


def test_paired_t_textbook_sleep_data():
    """Student (1908) / Cushny & Peebles sleep data, R's t.test(extra ~ group, paired = TRUE):
    t = 4.0621, df = 9, p = 0.002833, 95% CI [0.7001142, 2.4598858], mean 1.58."""
    r = paired_t([1.2, 2.4, 1.3, 1.3, 0.0, 1.0, 1.8, 0.8, 4.6, 1.4])
    assert (r["t"], r["df"], r["mean"]) == (pytest.approx(4.0621, abs=5e-5), 9, pytest.approx(1.58))
    assert r["p"] == pytest.approx(0.002833, abs=5e-7)
    assert (r["ci_low"], r["ci_high"]) == pytest.approx((0.7001142, 2.4598858), abs=5e-8)


def test_compare_seeds_matches_scipy():
    rng = np.random.default_rng(7)
    base = rng.random(80) < 0.5
    runs = [rng.random(80) < 0.62 for _ in range(3)]
    d = np.mean(runs, axis=0) - base
    ref = ttest_1samp(d, 0.0)
    r = compare_seeds(runs, base)
    assert r["p"] == pytest.approx(ref.pvalue, rel=1e-9) and r["t"] == pytest.approx(ref.statistic, rel=1e-9)
    half = student_t.ppf(0.975, 79) * d.std(ddof=1) / math.sqrt(80)
    assert (r["diff_ci_low"], r["diff_ci_high"]) == pytest.approx((d.mean() - half, d.mean() + half), rel=1e-9)
    ex = [sum(x) / 80 for x in runs]
    assert r["ex_seeds"] == pytest.approx(ex) and r["ex_mean"] == pytest.approx(sum(ex) / 3)
    assert r["ex_sd"] == pytest.approx(float(np.std(ex, ddof=1)))
    assert (r["ex_min"], r["ex_max"], r["ex_b"]) == pytest.approx((min(ex), max(ex), base.mean()))
    assert r["diff"] == pytest.approx(r["ex_mean"] - r["ex_b"])  # mean of per-question differences
    assert (r["p"] < 0.05) == (r["verdict"] != "no significant difference") == (r["diff_ci_low"] > 0
                                                                                 or r["diff_ci_high"] < 0)
    at_01 = compare_seeds(runs, base, alpha=0.01)
    assert at_01["diff_ci_high"] - at_01["diff_ci_low"] == pytest.approx(
        2 * student_t.ppf(0.995, 79) * d.std(ddof=1) / math.sqrt(80))


def test_compare_seeds_with_one_seed_is_the_paired_t_test():
    """d_i in {-1, 0, 1}: t^2 = (N - 1)(b - c)^2 / (N (b + c) - (b - c)^2), McNemar's statistic for large N."""
    a, b = pairs(150, 12, 3, 35)
    r = compare_seeds([a], b)
    assert r["t"] ** 2 == pytest.approx(199 * 81 / (200 * 15 - 81))
    assert r["p"] == pytest.approx(2 * student_t.sf(math.sqrt(199 * 81 / (200 * 15 - 81)), 199))
    assert r["diff"] == pytest.approx(compare(a, b)["diff"]) and r["verdict"] == "improved"
    assert r["seeds"] == 1 and math.isnan(r["ex_sd"]) and r["ex_min"] == r["ex_max"] == r["ex_mean"]
    same = compare_seeds([b, b], b)
    assert (same["p"], same["diff_ci_low"], same["diff_ci_high"], same["verdict"]) == (
        1.0, 0.0, 0.0, "no significant difference")
    perfect = compare_seeds([[True] * 5] * 2, [False] * 5)  # every d_i = 1: no variance left
    assert (perfect["p"], perfect["diff_ci_low"], perfect["verdict"]) == (0.0, 1.0, "improved")


def test_seeds_sharing_questions_are_not_independent_evidence():
    """Three seeds that each differ from the baseline on mostly the same questions: no seed alone is
    significant, and summing their discordant pairs into one McNemar test (33 vs 15) is, because it counts
    each shared question three times. The pooled test keeps the question as the unit."""
    n = 200
    base = np.array([False] * 10 + [True] * 4 + [True] * 100 + [False] * 86)
    runs = []
    for s in range(3):
        run = base.copy()
        run[:14] = ~base[:14]  # shared: right where the baseline was wrong (10), wrong where it was right (4)
        run[20 + s] = False  # each seed's own: one more loss, one more win
        run[150 + s] = True
        runs.append(run)
    per_seed = [compare(run, base) for run in runs]
    assert [(c["only_a"], c["only_b"], c["verdict"]) for c in per_seed] == [(11, 5, "no significant difference")] * 3
    summed = mcnemar([[0, 33], [15, 0]], exact=True).pvalue
    assert summed < 0.05  # the naive pooling would call it an improvement
    r = compare_seeds(runs, base)
    assert r["p"] > 0.05 and r["verdict"] == "no significant difference" and r["diff_ci_low"] < 0
    assert r["diff"] == pytest.approx(6 / n)


def test_pooled_test_keeps_its_level_where_summed_mcnemar_does_not():
    """No effect: baseline and 3 seeds drawn alike per question. The pooled test rejects ~5% of the time;
    summed discordant pairs, whose variance is (S + 1)/2 = 2 times what McNemar assumes, ~17%."""
    rng = np.random.default_rng(0)
    reps, n = 1000, 200
    q = rng.random((reps, 1, n))
    runs = rng.random((reps, 4, n)) < q  # [:, 0] the baseline, [:, 1:] the seeds
    base, seeds = runs[:, 0], runs[:, 1:]
    only_a = (seeds & ~base[:, None]).sum(axis=(1, 2))
    only_b = (~seeds & base[:, None]).sum(axis=(1, 2))
    summed = np.minimum(1, 2 * binom.cdf(np.minimum(only_a, only_b), only_a + only_b, 0.5))
    pooled = np.array([compare_seeds(list(seeds[i]), base[i])["p"] for i in range(reps)])
    assert (pooled < 0.05).mean() < 0.075
    assert (summed < 0.05).mean() > 0.12


@pytest.mark.parametrize("call", [
    lambda: compare_seeds([], [True, False]), lambda: compare_seeds([[True]], [True, False]),
    lambda: compare_seeds([[True]], [False]), lambda: compare([True, False], [True, True], alpha=0),
    lambda: compare_seeds([[True, False]], [True, True], alpha=1.5), lambda: exact_paired(5, 5, 8),
    lambda: paired_t([0.5])])
def test_bad_seed_input_raises(call):
    with pytest.raises(ValueError) as e:
        call()
    assert isinstance(e.value, SlmsqlError)
