"""How numbers are written in cards and run descriptions."""

from slmsql.wording import duration, pct, points, pts, pval


def test_numbers_in_words():
    assert (pct(0.3695), pct(None)) == ("37.0%", "n/a")
    assert (pts(0.01), pts(-0.007), pts(-0.0004), pts(0.0)) == ("+1.0", "−0.7", "0.0", "0.0")
    assert (pval(0.0004), pval(0.0042), pval(0.2268)) == ("< 0.001", "0.004", "0.23")
    assert points(0.0284) == "2.8"


def test_durations_in_words():
    assert (duration(12.4), duration(79), duration(510), duration(9720), duration(None)) == \
        ("12 s", "79 s", "8 min", "2 h 42 min", "n/a")
