import pytest

from slmsql.sql.matching import results_match


@pytest.mark.parametrize("mode", ["bird", "spider"])
def test_identical_and_empty(mode):
    assert results_match([(1, "a")], [(1, "a")], mode)
    assert results_match([], [], mode)
    assert not results_match([(1,)], [], mode)


def test_bird_is_set_semantics_with_column_order():
    assert results_match([(2,), (1,), (1,)], [(1,), (2,)], "bird")  # order and duplicates ignored
    assert not results_match([("a", 1)], [(1, "a")], "bird")  # column order matters


def test_spider_is_multiset_with_column_permutation():
    assert not results_match([(1,), (1,), (2,)], [(1,), (2,)], "spider")  # duplicates count
    assert results_match([("a", 1), ("b", 2)], [(1, "a"), (2, "b")], "spider")  # columns permuted
    assert not results_match([("a", 2), ("b", 1)], [(1, "a"), (2, "b")], "spider")  # rows must stay intact


def test_spider_row_order_only_with_order_by():
    pred, gold = [(2,), (1,)], [(1,), (2,)]
    assert results_match(pred, gold, "spider", "SELECT x FROM t")
    assert not results_match(pred, gold, "spider", "SELECT x FROM t ORDER BY x")
    assert results_match(gold, gold, "spider", "select x from t order  by x")


def test_values_floats_ints_text_null():
    assert results_match([(0.1 + 0.2,)], [(0.3,)])
    assert results_match([(1,)], [(1.0,)])
    assert not results_match([("1",)], [(1,)])
    assert results_match([(None,)], [(None,)])
    assert not results_match([(None,)], [(0,)])


def test_unknown_mode():
    with pytest.raises(ValueError, match="unknown match mode"):
        results_match([], [], "exact")
