"""Results past the sandbox's row cap are compared whole (as value digests), under both match modes; a
prediction stops as soon as it can no longer match; a gold over the digest budget is `gold_too_large`.

The database: big(id, name, score) with 30,000 rows (3x the default row_cap of 10,000: every gold below is
read past it as digests) where score = id as a REAL (5.0), and small(x) with 1,000 rows for a 1M-row cross join.
"""

from __future__ import annotations

import sqlite3

import pytest
from inline import InlineExecutor

from slmsql.sql.matching import Digests, results_match
from slmsql.sql.passrates import question_rows
from slmsql.sql.sandbox import Limits, SandboxPool, Whole, execute
from slmsql.sql.scoring import ex_summary, judge

N = 30_000
GOLD = "SELECT id, name FROM big"  # no ORDER BY: row order is not part of the answer in either mode
# (prediction, correct under bird, correct under spider)
CASES = {
    "same": (GOLD, True, True),
    "reordered": ("SELECT id, name FROM big ORDER BY id DESC", True, True),
    "missing_one_row": ("SELECT id, name FROM big WHERE id <> 7", False, False),
    "one_extra_row": (f"{GOLD} UNION ALL SELECT -1, 'extra'", False, False),
    # the modes' differences hold at this size too
    "columns_permuted": ("SELECT name, id FROM big", False, True),
    "one_duplicate_row": (f"{GOLD} UNION ALL SELECT id, name FROM big WHERE id = 7", True, False),
    "one_value_changed": ("SELECT id, CASE id WHEN 7 THEN 'x' ELSE name END FROM big", False, False),
}
ORDERED = "SELECT id, name FROM big ORDER BY id"  # spider: order is part of the answer (bird: never)
ORDERED_CASES = {
    "same_order": ("SELECT id, name FROM big ORDER BY id ASC", True, True),
    "reversed": ("SELECT id, name FROM big ORDER BY id DESC", True, False),
}


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("whole") / "big.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE big(id INTEGER PRIMARY KEY, name TEXT, score REAL)")
    conn.executemany("INSERT INTO big VALUES (?, ?, ?)", [(i, f"n{i % 977}", float(i)) for i in range(N)])
    conn.execute("CREATE TABLE small(x INTEGER)")
    conn.executemany("INSERT INTO small VALUES (?)", [(i,) for i in range(1000)])
    conn.commit()
    conn.close()
    return str(path)


def _verdicts(db, gold, cases, match, executor=None):
    outs = judge([(db, pred, gold) for pred, *_ in cases.values()], executor or InlineExecutor(), match)
    return {name: o.correct for name, o in zip(cases, outs)}, {name: o.status for name, o in zip(cases, outs)}


@pytest.mark.parametrize("match", ["bird", "spider"])
def test_golds_past_the_row_cap_are_scored_whole(db, match):
    col = 1 if match == "bird" else 2
    verdicts, statuses = _verdicts(db, GOLD, CASES, match)
    assert verdicts == {name: case[col] for name, case in CASES.items()}
    # Read to their end, except what has more (bird: distinct) rows than the gold: stopped, it cannot match.
    stopped = {"one_extra_row"} | ({"one_duplicate_row"} if match == "spider" else set())
    assert statuses == {name: "truncated" if name in stopped else "ok" for name in CASES}
    verdicts, _ = _verdicts(db, ORDERED, ORDERED_CASES, match)
    assert verdicts == {name: case[col] for name, case in ORDERED_CASES.items()}


def test_the_gold_really_is_read_as_digests(db):
    """Otherwise the test above would prove nothing about results past the row cap."""
    r = execute(db, GOLD, Limits(), Whole())
    assert r.status == "ok" and isinstance(r.rows, Digests) and (r.rows.n, r.rows.width) == (N, 2)
    assert len(r.rows.data) == N * 2 * 8  # 8 bytes a value: the stated budget's unit
    assert execute(db, GOLD).status == "truncated"  # a plain read keeps the row cap


@pytest.mark.parametrize("match", ["bird", "spider"])
def test_values_compare_as_today_past_the_row_cap(db, match):
    """1 == 1.0, 0.1 * 3 == 3 / 10.0 (9 significant digits), '5' != 5: digests keep sql/matching.py's rules."""
    cases = {"int_for_real": ("SELECT id, id FROM big", True),
             "text_for_real": ("SELECT id, CAST(id AS TEXT) FROM big", False)}
    verdicts, _ = _verdicts(db, "SELECT id, score FROM big", cases, match)
    assert verdicts == {name: ok for name, (_, ok) in cases.items()}
    cases = {"rounding": ("SELECT id, id * 0.1 FROM big", True), "off": ("SELECT id, id * 0.1 + 1e-6 FROM big", False)}
    verdicts, _ = _verdicts(db, "SELECT id, id / 10.0 FROM big", cases, match)
    assert verdicts == {name: ok for name, (_, ok) in cases.items()}


PAIRS = [((1,), (1.0,)), ((0.1 + 0.2,), (0.3,)), (("1",), (1,)), ((None,), (None,)), ((None,), (0,)),
         ((True,), (1,)), ((b"a",), ("a",)), ((2**53 + 1,), (float(2**53 + 1),)), ((1e20,), (10**20,)),
         ((-0.0,), (0,)), ((float("nan"),), (float("nan"),)), ((float("inf"),), (float("inf"),))]


@pytest.mark.parametrize("mode", ["bird", "spider"])
@pytest.mark.parametrize("pred,gold", PAIRS, ids=[repr(p) for p in PAIRS])
def test_digests_agree_with_value_comparison(pred, gold, mode):
    want = results_match([pred], [gold], mode)
    assert results_match(Digests.of([pred]), Digests.of([gold]), mode) == want
    assert results_match([pred], Digests.of([gold]), mode) == want  # mixed: the value side is digested


@pytest.mark.parametrize("match", ["bird", "spider"])
def test_a_1m_row_cross_join_stops_once_it_cannot_match(db, match):
    limits = Limits(timeout_s=60.0)
    (o,) = judge([(db, "SELECT a.x, b.x FROM small a, small b", GOLD)], InlineExecutor(limits), match)
    # stopped, not timed out: it ended before its 60 s deadline, on reaching the gold's 30,000 rows + 1
    assert (o.correct, o.status) == (False, "truncated")
    assert "cannot match" in o.error and f"{N:,}" in o.error and o.pred_ms < limits.timeout_s * 1e3


def test_bird_reads_duplicate_rows_past_the_row_cap(db):
    """A prediction with 30,001 rows but the gold's 3 distinct ones is right under bird (set semantics), so it
    is read to its end; under spider it is stopped at the gold's 3 rows + 1."""
    pred = "SELECT id % 3 FROM big UNION ALL SELECT 0"
    (bird,) = judge([(db, pred, "SELECT DISTINCT id % 3 FROM big")], InlineExecutor(), "bird")
    (spider,) = judge([(db, pred, "SELECT DISTINCT id % 3 FROM big")], InlineExecutor(), "spider")
    assert (bird.correct, bird.status) == (True, "ok")
    assert (spider.correct, spider.status) == (False, "truncated")


def test_a_gold_over_the_digest_budget_is_gold_too_large(db):
    limits = Limits(digest_bytes=20_000 * 2 * 8)  # 20,000 rows of 2 columns (40,000 of 1): the gold has 30,000
    outs = judge([(db, GOLD, GOLD), (db, "SELECT id FROM big", "SELECT id FROM big")], InlineExecutor(limits))
    assert [(o.correct, o.status) for o in outs] == [(False, "gold_too_large"), (True, "ok")]
    assert "digest budget" in outs[0].error
    results = [{"correct": o.correct, "status": o.status} for o in outs]
    assert ex_summary(results)["exec/gold_too_large"] == 0.5  # evaluate's metric names it


def test_the_filter_puts_a_gold_too_large_in_errors(db, tmp_path):
    from slmsql.inputs.data import Example

    root = tmp_path / "dbs"
    (root / "big").mkdir(parents=True)
    (root / "big" / "big.sqlite").symlink_to(db)
    ex = [Example(id="q", db_id="big", question="all", sql=GOLD)]
    rows = question_rows(ex, {"q": [f"```sql\n{GOLD}\n```"] * 2}, db_root=root, k=2, low=0.2, high=0.8,
                         match="bird", executor=InlineExecutor(Limits(digest_bytes=1 << 16)))
    assert rows[0]["bucket"] == "errors" and "digest budget" in rows[0]["error"]


def test_pool_scores_whole_results_and_keeps_its_cache_small(db):
    """Through worker processes (Digests cross a pipe); a digest gold is not kept in the gold cache."""
    with SandboxPool(workers=1) as pool:
        verdicts, _ = _verdicts(db, GOLD, CASES, "spider", pool)
        assert verdicts == {name: case[2] for name, case in CASES.items()}
        assert not pool._gold
        pool.run_gold([(db, "SELECT 1")])
        assert list(pool._gold) == [(db, "SELECT 1")]
