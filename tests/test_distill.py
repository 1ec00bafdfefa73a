"""suites/distill.py: a database joins the pool only when it tells apart a pair no pooled one does, or fills an
empty gold; then up to `cap` are chosen greedily, filling golds first, then telling pairs apart."""

import pytest

from slmsql.suites.distill import Candidate, Distiller, distill


def _c(name, apart=(), nonempty=()):
    return Candidate(name, frozenset(apart), frozenset(nonempty))


NEIGHBOURS = {"q1": 3, "q2": 2, "q3": 0}


def test_keeps_only_databases_that_add_something_the_most_filling_first():
    cands = [_c("a", {("q1", 0), ("q1", 1)}, {"q1"}),
             _c("b", {("q1", 0)}, {"q1"}),  # nothing new when scanned: never pooled
             _c("c", {("q2", 0)}),  # a new pair when scanned, but e tells it apart too
             _c("d", set(), {"q3"}),  # tells nothing apart, but q3's gold has rows only here
             _c("e", {("q1", 1), ("q2", 0)}, {"q1", "q2"})]  # fills two golds: chosen first
    d = distill(cands, NEIGHBOURS, cap=10)
    assert d.kept == ("e", "d", "a")  # c adds nothing once e is in
    assert d.coverage == {"q1": pytest.approx(2 / 3), "q2": 0.5, "q3": None}
    assert d.empty == ()


def test_the_scan_goes_past_the_cap_so_a_later_better_database_wins():
    """Stopping at the cap would keep x, the first that tells anything apart; y tells apart all three."""
    cands = [_c("x", {("q1", 0)}, {"q1"}), _c("y", {("q1", 0), ("q1", 1), ("q1", 2)}, {"q1"})]
    assert distill(cands, NEIGHBOURS, cap=1).kept == ("y",)
    assert distill(cands[::-1], NEIGHBOURS, cap=1).kept == ("y",)  # x adds nothing after y: never pooled


def test_the_cap_and_questions_left_empty():
    cands = [_c("a", {("q1", 0)}, {"q1"}), _c("b", {("q1", 2)}), _c("c", {("q2", 1)}, {"q2"})]
    d = distill(cands, NEIGHBOURS, cap=2)
    assert d.kept == ("a", "c")  # a and c tie on what they add: the earlier first; b fills nothing
    assert d.coverage["q1"] == pytest.approx(1 / 3) and d.coverage["q2"] == 0.5
    assert d.empty == ("q3",)  # no database where q3's gold has rows
    assert distill(cands, NEIGHBOURS, cap=1).empty == ("q2", "q3")


def test_ties_go_to_the_earlier_candidate_and_the_result_is_deterministic():
    cands = [_c("a", {("q1", 0)}), _c("b", {("q1", 1)})]
    assert distill(cands, NEIGHBOURS, cap=1).kept == ("a",)
    assert distill(cands[::-1], NEIGHBOURS, cap=1).kept == ("b",)
    assert distill(cands, NEIGHBOURS, cap=5) == distill(cands, NEIGHBOURS, cap=5)


def test_complete_once_every_pair_is_told_and_every_gold_filled():
    d = Distiller({"q1": 2, "q2": 0}, cap=3)
    d.offer(_c("a", {("q1", 0), ("q1", 1)}, {"q1"}))
    assert not d.complete  # q2's gold has rows nowhere yet
    assert not d.offer(_c("b", {("q1", 0)}, {"q1"})) and d.offer(_c("c", set(), {"q2"}))
    assert d.complete and d.result().kept == ("a", "c")


def test_a_cap_below_one_is_refused():
    with pytest.raises(ValueError, match="cap"):
        distill([], NEIGHBOURS, cap=0)
