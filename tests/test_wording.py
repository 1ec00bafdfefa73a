"""How numbers are written in cards and run descriptions."""

from slmsql.stats.wording import bound, duration, pct, points, pts, pval, training_time


def test_numbers_in_words():
    assert (pct(0.3695), pct(None)) == ("37.0%", "n/a")
    assert (pts(0.01), pts(-0.007), pts(-0.0004), pts(0.0)) == ("+1.0", "−0.7", "0.0", "0.0")
    assert (pval(0.0004), pval(0.0042), pval(0.2268)) == ("< 0.001", "0.004", "0.23")
    assert points(0.0284) == "2.8"


def test_a_bound_that_rounds_to_0_shows_its_side_of_0():
    """An interval [−2.4, −0.04] excludes 0; written [−2.4, 0.0] it reads as touching it: one more digit."""
    assert (bound(-0.0004), bound(0.0003), bound(-0.00004), bound(0.0), bound(-0.024), bound(None)) == (
        "−0.04", "+0.03", "−0.00", "0.0", "−2.4", "n/a")
    assert bound(-0.0004, minus="-") == "-0.04"


def test_durations_in_words():
    assert (duration(12.4), duration(79), duration(510), duration(9720), duration(None)) == \
        ("12 s", "79 s", "8 min", "2 h 42 min", "n/a")


def test_a_resumed_run_says_which_steps_its_time_is_for():
    """GRPO's `--resume` times only the steps after its checkpoint: 2670 s for steps 21-75 is not 75 steps' time."""
    assert (training_time(75, 2670), training_time(75, 2670, 0), training_time(75, 2670, None)) == ("44 min",) * 3
    assert training_time(75, 2670, 20) == ("44 min for steps 21-75 (resumed from its step-20 checkpoint; the time "
                                           "before it is not counted)")
    assert training_time(75.0, 12.0, 74.0).startswith("12 s for steps 75-75 ")  # metrics come back as floats


def test_a_comparison_in_one_table_cell():
    from slmsql.stats.wording import ex_result, result

    c = {"ex_a": 0.370, "ex_b": 0.395, "diff": -0.025, "diff_ci_low": -0.067, "diff_ci_high": 0.024,
         "mcnemar_p": 0.3833103, "verdict": "no significant difference"}
    assert result(c) == "37.0% vs 39.5%, −2.5 pts [−6.7, +2.4], p 0.38, no sig. difference"
    assert result({**c, "diff": 0.1, "mcnemar_p": 0.0004, "verdict": "improved"}).endswith(
        "+10.0 pts [−6.7, +2.4], p < 0.001, improved")
    assert ex_result({"ex": 0.3695, "ex_ci_low": 0.291, "ex_ci_high": 0.452}) == "37.0% [29.1%, 45.2%]"
