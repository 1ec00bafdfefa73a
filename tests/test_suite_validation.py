"""A built suite against the one real Spider database in the tests (tests/data/concert_singer, CC BY-SA 4.0): for
wrong-but-close predictions (every gold's neighbours, and the 45 answers of Qwen2.5-Coder-0.5B-Instruct zero-shot,
see that folder's README) the suite's verdict (`test-suite` on the suite `slmsql suite build` makes from the
schema and the golds) beside EX on the real database (`spider` on concert_singer.sqlite). The 2x2 table is in
docs/spider.md. The suite must never call right what the real database shows wrong."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from inline import InlineExecutor

from slmsql.sql.scoring import judge
from slmsql.suites.build import Params, build_suite, read_inputs
from slmsql.suites.neighbours import neighbours
from slmsql.suites.schema import Schema

REAL = Path(__file__).parent / "data" / "concert_singer"
PREDICTIONS = REAL / "predictions-qwen2.5-coder-0.5b.jsonl"


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """(source, suite says right, real database says right) for every prediction both could run."""
    entries, questions = read_inputs(REAL / "tables.json", REAL / "dev.jsonl")
    entry, qs = entries["concert_singer"], questions["concert_singer"]
    root = tmp_path_factory.mktemp("suite")
    build_suite(entry, qs, root / "concert_singer", root / "scratch", Params(), InlineExecutor())
    model = {r["id"]: r["sql"] for r in map(json.loads, PREDICTIONS.read_text().splitlines())}
    columns = Schema(entry).table_columns()
    items = [(q, n.sql, "neighbour") for q in qs for n in neighbours(q.sql, columns)]
    items += [(q, model[q.id], "model") for q in qs]
    ex = InlineExecutor()
    suite = judge([(root / "concert_singer" / "concert_singer.sqlite", p, q.sql) for q, p, _ in items], ex,
                  "test-suite")
    real = judge([(REAL / "concert_singer.sqlite", p, q.sql) for q, p, _ in items], ex, "spider")
    assert [s.status for s in suite] == [r.status for r in real]  # a prediction runs on both or on neither
    return [(src, s.correct, r.correct, q.id, p) for (q, p, src), s, r in zip(items, suite, real)
            if s.status == "ok"]


def table(rows, source):
    return Counter((s, r) for src, s, r, *_ in rows if src == source)


@pytest.mark.slow
def test_the_suite_never_calls_right_what_the_real_database_shows_wrong(verdicts):
    false_right = [(q, p) for src, s, r, q, p in verdicts if s and not r]
    assert false_right == []
    for source in ("neighbour", "model"):
        t = table(verdicts, source)
        print(f"{source}: both right {t[True, True]}, suite wrong / real right {t[False, True]}, "
              f"both wrong {t[False, False]}, suite right / real wrong {t[True, False]}")


@pytest.mark.slow
def test_the_models_answers_get_the_same_verdict_from_both(verdicts):
    """On the model's 45 answers the suite and the real database agree (18 right, 27 wrong when written): where
    they part, the suite would be stricter than the real data, which a model's answer should rarely show."""
    t = table(verdicts, "model")
    assert t[True, True] >= 15 and t[False, True] == 0 and t[True, False] == 0


@pytest.mark.slow  # the fixture builds and judges a whole suite: seconds, outside the fast tier (issue 55)
def test_the_suite_tells_apart_neighbours_the_real_database_cannot(verdicts):
    """Many neighbours are right on concert_singer's few rows by coincidence (6 singers, 6 concerts); the suite,
    built to tell them apart, calls most of those wrong. Those it still calls right are left for docs/spider.md."""
    t = table(verdicts, "neighbour")
    assert t[False, True] > 100 and t[True, True] < t[False, True] / 2


def test_the_material_pairs_every_gold_with_one_answer_and_every_gold_runs_on_the_real_database():
    """What the comparison above stands on: the model answered each of the 45 questions once, and the real
    database judges each gold right against itself (a gold that failed there would leave its question out)."""
    _, questions = read_inputs(REAL / "tables.json", REAL / "dev.jsonl")
    qs = questions["concert_singer"]
    answered = [r["id"] for r in map(json.loads, PREDICTIONS.read_text().splitlines())]
    assert len(qs) == 45 and sorted(answered) == sorted(q.id for q in qs)
    golds = judge([(REAL / "concert_singer.sqlite", q.sql, q.sql) for q in qs], InlineExecutor(), "spider")
    assert all(g.status == "ok" and g.correct for g in golds), [q.id for q, g in zip(qs, golds) if not g.correct]
