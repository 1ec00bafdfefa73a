"""suites/distill.py: keep a database only when it tells apart a pair no kept one does, or fills an empty gold."""

import pytest

from slmsql.suites.distill import Candidate, distill


def _c(name, apart=(), nonempty=()):
    return Candidate(name, frozenset(apart), frozenset(nonempty))


NEIGHBOURS = {"q1": 3, "q2": 2, "q3": 0}


def test_keeps_only_databases_that_add_something():
    cands = [_c("a", {("q1", 0), ("q1", 1)}, {"q1"}),
             _c("b", {("q1", 0)}, {"q1"}),  # nothing new: dropped
             _c("c", {("q2", 0)}),  # a new pair
             _c("d", set(), {"q3"}),  # tells nothing apart, but q3's gold has rows only here
             _c("e", {("q1", 1), ("q2", 0)}, {"q1", "q2"})]  # q2 non-empty for the first time
    d = distill(cands, NEIGHBOURS, cap=10)
    assert d.kept == ("a", "c", "d", "e")
    assert d.coverage == {"q1": pytest.approx(2 / 3), "q2": 0.5, "q3": None}
    assert d.empty == ()


def test_the_cap_and_questions_left_empty():
    cands = [_c("a", {("q1", 0)}, {"q1"}), _c("b", {("q1", 2)}), _c("c", {("q2", 1)}, {"q2"})]
    d = distill(cands, NEIGHBOURS, cap=2)
    assert d.kept == ("a", "b")
    assert d.coverage["q1"] == pytest.approx(2 / 3) and d.coverage["q2"] == 0.0
    assert d.empty == ("q2", "q3")


def test_order_decides_and_is_all_that_decides():
    cands = [_c("a", {("q1", 0)}), _c("b", {("q1", 0), ("q1", 1)})]
    assert distill(cands, NEIGHBOURS, cap=5).kept == ("a", "b")
    assert distill(cands[::-1], NEIGHBOURS, cap=5).kept == ("b",)
    assert distill(cands, NEIGHBOURS, cap=5) == distill(cands, NEIGHBOURS, cap=5)


def test_a_cap_below_one_is_refused():
    with pytest.raises(ValueError, match="cap"):
        distill([], NEIGHBOURS, cap=0)
