"""`--match test-suite`: a question is judged on every `*.sqlite` of `<db_root>/<db_id>/` (Spider's released
test-suite layout) under spider's rules, and is right only if right on all of them.

The suite `club` has three databases of one schema, singer(id, name, age):

    club.sqlite   (first: today's one-database EX)  Ann 25, Bob 41, Cid 35
    club_1.sqlite                                   Ann 30, Bob 41, Dee 30
    club_2.sqlite                                   Eve 52, Fay 19

`age >= 30` for the gold's `age > 30` is right on club.sqlite (no one is 30 there) and wrong on club_1: the suite
calls it wrong, one-database EX right. `name = 'Zed'` finds no one anywhere: a gold the suite cannot judge.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys

import pytest
import watched
from inline import InlineExecutor

from slmsql.rewards import registry as rewards
from slmsql.sql.passrates import question_rows
from slmsql.sql.scoring import judge

ROWS = {"club": [(1, "Ann", 25), (2, "Bob", 41), (3, "Cid", 35)],
        "club_1": [(1, "Ann", 30), (2, "Bob", 41), (3, "Dee", 30)],
        "club_2": [(1, "Eve", 52), (2, "Fay", 19)]}
GOLD = "SELECT name FROM singer WHERE age > 30"
CLOSE = "SELECT name FROM singer WHERE age >= 30"  # right on club.sqlite only
EMPTY = "SELECT name FROM singer WHERE name = 'Zed'"


def _make(path, rows, schema="CREATE TABLE singer (id INTEGER PRIMARY KEY, name TEXT, age INTEGER)"):
    con = sqlite3.connect(path)
    con.execute(schema)
    con.executemany(f"INSERT INTO singer VALUES ({', '.join('?' * len(rows[0]))})", rows)
    con.commit()
    con.close()


@pytest.fixture
def suites(tmp_path):
    """<root>/club/: a suite of three; <root>/solo/: a suite of one (club.sqlite's rows)."""
    root = tmp_path / "dbs"
    for db_id, names in (("club", ROWS), ("solo", {"solo": ROWS["club"]})):
        (root / db_id).mkdir(parents=True)
        for name, rows in names.items():
            _make(root / db_id / f"{name}.sqlite", rows)
    return root


def _first(root, db_id="club"):
    return str(root / db_id / f"{db_id}.sqlite")


def test_a_prediction_right_on_one_database_only_is_wrong_on_the_suite(suites):
    items = [(_first(suites), CLOSE, GOLD), (_first(suites), GOLD, GOLD)]
    one_db = judge(items, InlineExecutor(), "spider")
    suite = judge(items, InlineExecutor(), "test-suite")
    assert [o.correct for o in one_db] == [True, True]  # today's EX cannot tell them apart
    assert [(o.correct, o.status, o.single) for o in suite] == [(False, "ok", True), (True, "ok", True)]


def test_a_suite_of_one_is_todays_ex(suites):
    items = [(_first(suites, "solo"), CLOSE, GOLD), (_first(suites, "solo"), "SELECT name FROM singer", GOLD)]
    assert [o.correct for o in judge(items, InlineExecutor(), "test-suite")] == [True, False]


def test_a_gold_empty_on_every_database_is_not_judged(suites):
    (o,) = judge([(_first(suites), "SELECT name FROM singer WHERE 0", EMPTY)], InlineExecutor(), "test-suite")
    assert (o.correct, o.status) == (False, "gold_empty") and "3 databases" in o.error
    # empty on some databases only is fine: club_2 has no one between 20 and 29 but club has Ann
    (o,) = judge([(_first(suites), "SELECT name FROM singer WHERE age BETWEEN 20 AND 29",
                   "SELECT name FROM singer WHERE age < 30 AND age > 19")], InlineExecutor(), "test-suite")
    assert (o.correct, o.status) == (True, "ok")


def test_a_gold_that_fails_on_a_database_names_it(suites):
    (suites / "club" / "club_3.sqlite").unlink(missing_ok=True)
    _make(suites / "club" / "club_3.sqlite", [(1, "Gus")], schema="CREATE TABLE singer (id INTEGER, name TEXT)")
    (o,) = judge([(_first(suites), GOLD, GOLD)], InlineExecutor(), "test-suite")
    assert o.status == "gold_error" and "club_3.sqlite" in o.error and "age" in o.error


def test_each_database_runs_under_the_sandbox(suites):
    """A prediction the sandbox refuses is refused (once per database: the first refusal is reported)."""
    (o,) = judge([(_first(suites), "PRAGMA table_info(singer)", GOLD)], InlineExecutor(), "test-suite")
    assert (o.correct, o.status) == (False, "rejected") and o.error.startswith("on club.sqlite")


# ---- the agreement fixtures: the match modes' cases (BIRD's and test-suite-sql-eval's rules) ----------------

def test_suites_of_one_agree_with_spider_on_every_agreement_case(shop):
    from test_match_modes import CASES, MODE

    db = str(shop / "shop" / "shop.sqlite")
    items = [(db, pred, gold) for gold, pred, *_ in CASES.values()]
    suite = [o.correct for o in judge(items, InlineExecutor(), "test-suite")]
    assert suite == [case[MODE["spider"]] for case in CASES.values()]
    assert suite == [o.correct for o in judge(items, InlineExecutor(), "spider")]


# ---- reward and filter ---------------------------------------------------------------------------------------

def test_the_reward_pays_only_the_whole_suite_and_logs_the_disagreement(suites):
    completions = [f"```sql\n{sql}\n```" for sql in (CLOSE, GOLD, "SELECT 1", CLOSE)]
    logged = {}
    got = rewards.execution_reward(None, completions, sql=[GOLD] * 4, db_path=[_first(suites)] * 4,
                                   executor=InlineExecutor(), match="test-suite", id=["q"] * 4,
                                   log_metric=logged.__setitem__)
    assert got == [0.1, 1.0, 0.1, 0.1]
    assert logged["exec/suite_single_disagree"] == 0.5  # the two CLOSE answers: one database says right
    from slmsql.tracking import vocabulary

    assert all(vocabulary.documented(k, "grpo") for k in logged)
    one_db = rewards.execution_reward(None, completions, sql=[GOLD] * 4, db_path=[_first(suites)] * 4,
                                      executor=InlineExecutor(), match="spider")
    assert one_db == [1.0, 1.0, 0.1, 1.0]


def test_the_filter_puts_a_gold_empty_question_in_errors(suites):
    from slmsql.inputs.data import Example

    examples = [Example("q1", "club", "q", GOLD), Example("q2", "club", "q", EMPTY)]
    done = {e.id: [f"```sql\n{s}\n```" for s in (GOLD, CLOSE)] for e in examples}
    rows = question_rows(examples, done, db_root=suites, k=2, low=0.2, high=0.8, match="test-suite",
                         executor=InlineExecutor())
    assert [(r["id"], r["bucket"]) for r in rows] == [("q1", "band"), ("q2", "errors")]
    assert "no rows" in rows[1]["error"]


# ---- evaluate from the command line, in a new process -------------------------------------------------------

@pytest.mark.slow
def test_evaluate_cli_in_test_suite_mode(suites, tmp_path):
    qs = {"close": (GOLD, CLOSE), "right": (GOLD, GOLD), "wrong": (GOLD, "SELECT name FROM singer"),
          "empty": (EMPTY, "SELECT name FROM singer WHERE 0"), "nosql": (GOLD, "")}
    gold = tmp_path / "gold.jsonl"
    gold.write_text("".join(json.dumps({"id": k, "db_id": "club", "question": k, "sql": g}) + "\n"
                            for k, (g, _) in qs.items()))
    preds = tmp_path / "preds.jsonl"
    preds.write_text("".join(json.dumps({"id": k, "sql": p}) + "\n" for k, (_, p) in qs.items()))
    out = tmp_path / "out"
    env = {**os.environ, "MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"]}
    run = watched.run([sys.executable, "-m", "slmsql.cli", "evaluate", "--data", str(gold), "--db-root",
                       str(suites), "--predictions", str(preds), "--output-dir", str(out), "--workers", "1",
                       "--match", "test-suite"], env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["id"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert {k: (r["status"], r.get("single_db_correct")) for k, r in rows.items()} == {
        "close": ("wrong_result", True), "right": ("correct", True), "wrong": ("wrong_result", False),
        "empty": ("gold_empty", None), "nosql": ("no_sql", False)}
    m = json.loads((out / "metrics.json").read_text())
    # the empty gold is reported, not counted: 1 right of 4 scored; one database alone would say 2 of 4 (an answer
    # with no SQL is wrong there too, and the figure is kept: it was dropped when any answer had no SQL)
    assert (m["n"], m["n_correct"], m["gold_unscored_ids"], m["n_gold_unscored"]) == (4, 1, ["empty"], 1)
    assert m["ex_single_db"] == pytest.approx(2 / 4) and m["suite_single_disagree"] == pytest.approx(1 / 4)

    import mlflow

    (r,) = mlflow.search_runs(experiment_names=["slmsql"], output_format="list")
    assert r.data.tags["slmsql.match"] == "test-suite" and r.data.metrics["n_gold_unscored"] == 1
    from slmsql.tracking import vocabulary

    assert not [k for k in r.data.metrics if not vocabulary.documented(k, "evaluate")]
