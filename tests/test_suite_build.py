"""`slmsql suite build`: test suites generated from a schema and its golds (suites/schema, pools, fill, build), on the
one real Spider database in the tests (tests/data/concert_singer, CC BY-SA 4.0: its tables.json entry, its 45 dev
golds; see its README), scored through the existing `test-suite` match mode."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from inline import InlineExecutor

from slmsql.errors import DataError
from slmsql.sql.scoring import judge
from slmsql.suites import fill
from slmsql.suites.build import Params, build_suite, manifest, read_inputs
from slmsql.suites.neighbours import neighbours
from slmsql.suites.pools import literal_pools
from slmsql.suites.schema import Schema

REAL = Path(__file__).parent / "data" / "concert_singer"
TABLES, DEV = REAL / "tables.json", REAL / "dev.jsonl"
REAL_TOLD_APART, REAL_NEIGHBOURS = 1076, 1259  # the real database's figures (tests/test_neighbours.py, docs/scoring.md)


def _rows(db, sql):
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


@pytest.fixture(scope="module")
def inputs():
    entries, questions = read_inputs(TABLES, DEV)
    return entries["concert_singer"], questions["concert_singer"]


@pytest.fixture(scope="module")
def built(inputs, tmp_path_factory):
    """concert_singer's suite with the stage's defaults, built in this process."""
    entry, qs = inputs
    root = tmp_path_factory.mktemp("suite")
    suite = build_suite(entry, qs, root / "concert_singer", root / "scratch", Params(), InlineExecutor())
    return root, suite


# ---- filling ----------------------------------------------------------------------------------------------------

def test_children_draw_their_parents_keys_and_joins_find_rows(inputs, tmp_path):
    entry, qs = inputs
    schema = Schema(entry)
    assert [t.name for t in schema.order][-1] == "singer_in_concert" and not schema.deferred
    pools = literal_pools(schema, [q.sql for q in qs])
    for i in range(5):
        db = tmp_path / f"c{i}.sqlite"
        fill.write(db, schema, fill.generate(schema, pools, [5, 30], fill.rng_for(0, "concert_singer", i)))
        for child, col, parent, key in (("concert", "Stadium_ID", "stadium", "Stadium_ID"),
                                        ("singer_in_concert", "Singer_ID", "singer", "Singer_ID"),
                                        ("singer_in_concert", "concert_ID", "concert", "concert_ID")):
            keys = {str(k) for (k,) in _rows(db, f"SELECT {key} FROM {parent}")}  # TEXT columns hold '3' for 3
            assert {str(v) for (v,) in _rows(db, f"SELECT {col} FROM {child}")} <= keys
            assert _rows(db, f"SELECT count(*) FROM {child} AS c JOIN {parent} AS p ON c.{col} = p.{key}")[0][0] > 0
        ids = [k for (k,) in _rows(db, "SELECT Singer_ID FROM singer")]
        assert len(ids) == len(set(ids))  # a primary key is unique


def test_a_cycle_and_a_self_reference_are_filled_after_every_table(tmp_path):
    entry = {"db_id": "loop", "table_names_original": ["a", "b", "person"],
             "column_names_original": [[-1, "*"], [0, "id"], [0, "b_id"], [1, "id"], [1, "a_id"], [2, "id"],
                                       [2, "boss_id"]],
             "column_types": ["text", "number", "number", "number", "number", "number", "number"],
             "primary_keys": [1, 3, 5], "foreign_keys": [[2, 3], [4, 1], [6, 5]]}
    schema = Schema(entry)
    assert schema.deferred == {("b", "a_id"), ("person", "boss_id")}  # a -> b -> a, person -> person
    db = tmp_path / "loop.sqlite"
    fill.write(db, schema, fill.generate(schema, {}, [8], fill.rng_for(3, "loop", 0)))
    for child, col, parent in (("a", "b_id", "b"), ("b", "a_id", "a"), ("person", "boss_id", "person")):
        values = {v for (v,) in _rows(db, f"SELECT {col} FROM {child}")}
        assert None not in values and values <= {k for (k,) in _rows(db, f"SELECT id FROM {parent}")}


def test_gold_literals_land_in_their_columns_and_follow_foreign_keys(inputs):
    entry, qs = inputs
    schema = Schema(entry)
    pools = literal_pools(schema, [q.sql for q in qs])
    assert "France" in pools["singer", "country"]
    assert {2013, 2014, 2015, 2016} <= set(pools["concert", "year"])  # 2014 and 2015, each with v - 1 and v + 1
    assert {4999, 5000, 10000, 10001} <= set(pools["stadium", "capacity"])  # BETWEEN 5000 AND 10000
    assert {20, 21, 40, 30} <= set(pools["singer", "age"])
    assert any("hey" in s.lower() for s in pools["singer", "song_name"])  # LIKE '%Hey%' made into matching text
    # a literal on a child's foreign key reaches the parent's key (and back); a double-quoted word is text
    more = literal_pools(schema, ['SELECT * FROM concert WHERE stadium_id = 7', 'SELECT * FROM singer AS T1 '
                                  'WHERE T1.name = "Kyle"', 'SELECT name FROM stadium WHERE stadium_id > 40'])
    assert {7, 41} <= set(more["stadium", "stadium_id"]) and {7, 41} <= set(more["concert", "stadium_id"])
    assert more["singer", "name"] == ["Kyle"]


@pytest.mark.slow  # seconds of new processes or whole builds: outside the fast tier (issue 55)
def test_the_same_seed_gives_the_same_bytes_another_seed_others(inputs, tmp_path):
    entry, qs = inputs

    def hashes(seed, name):
        s = build_suite(entry, qs, tmp_path / name / "concert_singer", tmp_path / name / "scratch",
                        Params(seed=seed, cap=2), InlineExecutor())
        return [(f["name"], f["sha256"], f["content_sha256"]) for f in s.files]

    first, again, other = hashes(0, "a"), hashes(0, "b"), hashes(1, "c")
    assert first == again and len(first) == 2
    assert {h for _, h, _ in first}.isdisjoint({h for _, h, _ in other})
    assert (tmp_path / "a" / "concert_singer" / "concert_singer_1.sqlite").read_bytes() == \
        (tmp_path / "b" / "concert_singer" / "concert_singer_1.sqlite").read_bytes()


# ---- the built suite ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_every_gold_has_rows_on_some_kept_database_or_is_listed(built, inputs):
    root, suite = built
    _, qs = inputs
    dbs = sorted((root / "concert_singer").glob("*.sqlite"))
    assert dbs[0].name == "concert_singer.sqlite" and len(dbs) == len(suite.files) <= Params().cap
    listed = {e["id"]: e["reason"] for e in suite.empty + suite.failed}
    for q in qs:
        assert any(_rows(db, q.sql) for db in dbs) or "no rows" in listed.get(q.id, ""), q.id
    assert listed == {}  # concert_singer's golds all find rows (ids 14 and 15 included: none on the real database)


@pytest.mark.slow
def test_each_gold_is_right_against_itself_in_test_suite_mode(built, inputs):
    root, _ = built
    _, qs = inputs
    first = root / "concert_singer" / "concert_singer.sqlite"
    outs = judge([(first, q.sql, q.sql) for q in qs], InlineExecutor(), "test-suite")
    assert [(q.id, o.correct, o.status) for q, o in zip(qs, outs)] == [(q.id, True, "ok") for q in qs]


@pytest.mark.slow
def test_the_suite_tells_apart_more_neighbours_than_the_real_database(built, inputs):
    """The manifest's figure, recomputed through the `test-suite` mode: a neighbour the suite calls wrong is one it
    tells apart. The real database tells 1,076 of the 1,259 executable neighbours apart."""
    root, suite = built
    entry, qs = inputs
    columns = Schema(entry).table_columns()
    first = root / "concert_singer" / "concert_singer.sqlite"
    items = [(first, n.sql, q.sql) for q in qs for n in neighbours(q.sql, columns)]
    outs = judge(items, InlineExecutor(), "test-suite")
    ran = [o for o in outs if o.status == "ok"]
    told = sum(not o.correct for o in ran)
    summary = manifest(Params(), [suite], {})["summary"]
    assert (summary["n_neighbours"], summary["n_told_apart"]) == (len(ran), told)
    assert len(ran) == REAL_NEIGHBOURS and told > REAL_TOLD_APART
    print(f"concert_singer suite: {len(suite.files)} databases, {told} of {len(ran)} neighbours told apart "
          f"(real database: {REAL_TOLD_APART}); coverage mean {summary['coverage_mean']:.3f}, "
          f"min {summary['coverage_min']:.3f}; {suite.looked_at} candidates in {suite.seconds} s")


def test_the_manifest_check_fails_on_a_file_that_is_not_the_one_hashed(inputs, tmp_path):
    from slmsql.checks.datachecks import validate_manifest

    entry, qs = inputs  # a small build (5 golds): the check reads files and hashes, not coverage
    params = Params(cap=3, candidates=20)
    folder = tmp_path / "suite"
    suite = build_suite(entry, qs[:5], folder / "concert_singer", tmp_path / "scratch", params, InlineExecutor())
    (folder / "manifest.json").write_text(json.dumps(manifest(params, [suite], {})))
    assert validate_manifest(folder).success
    with open(folder / suite.files[-1]["name"], "ab") as f:
        f.write(b"\0")
    report = validate_manifest(folder)
    assert [r["expectation"] for r in report.failed] == ["files_match_their_hashes"]


# ---- inputs refused, naming file, line and field -------------------------------------------------------------

@pytest.mark.parametrize("line, field, match", [
    ('{"id": "a", "db_id": "nowhere", "question": "q", "sql": "SELECT 1"}', "db_id", "unknown db_id 'nowhere'"),
    ('{"id": "a", "db_id": "concert_singer", "question": "q", "sql": "SELECT FROM WHERE ("}', "sql", "sqlglot"),
    ('{"id": "a", "db_id": "concert_singer", "question": "q"', None, "malformed JSON")])
def test_bad_input_is_refused_by_file_line_and_field(tmp_path, line, field, match):
    data = tmp_path / "q.jsonl"
    data.write_text('{"id": "ok", "db_id": "concert_singer", "question": "q", "sql": "SELECT 1"}\n\n' + line + "\n")
    with pytest.raises(DataError, match=match) as e:
        read_inputs(TABLES, data)
    assert (e.value.path, e.value.line, e.value.field) == (data, 3, field)


def test_spider_json_records_and_unknown_db_ids_are_named(tmp_path):
    data = tmp_path / "dev.json"
    data.write_text(json.dumps([{"db_id": "concert_singer", "question": "q", "query": "SELECT 1"},
                                {"db_id": "concert_singer", "question": "q", "query": "SELECT (("}]))
    with pytest.raises(DataError) as e:
        read_inputs(TABLES, data)
    assert (e.value.line, e.value.field) == (1, "query")
    with pytest.raises(DataError, match="no questions of \\['pets_1'\\]"):
        read_inputs(TABLES, DEV, ["pets_1"])
    with pytest.raises(DataError, match="cannot read tables.json"):
        read_inputs(tmp_path / "missing.json", DEV)


# ---- the command, in a new process ---------------------------------------------------------------------------

@pytest.mark.slow  # seconds of new processes or whole builds: outside the fast tier (issue 55)
def test_suite_build_cli_writes_the_suite_and_an_mlflow_run(tmp_path):
    import mlflow

    out = tmp_path / "suites"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "slmsql.cli", "suite", "build", "--tables", str(TABLES), "--data", str(DEV),
           "--output-dir", str(out), "--seed", "0", "--workers", "1"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    man = json.loads((out / "manifest.json").read_text())
    assert man["files"][0]["name"] == "concert_singer/concert_singer.sqlite"
    assert {f.name for f in (out / "concert_singer").iterdir()} == {f["name"].split("/")[1] for f in man["files"]}
    assert len(man["questions"]) == 45 and man["parameters"]["seed"] == 0
    (r,) = mlflow.search_runs(experiment_names=["slmsql"], output_format="list")
    assert r.data.tags["slmsql.stage"] == "suite build" and r.info.status == "FINISHED"
    assert r.data.metrics["n_questions"] == 45 and r.data.metrics["n_told_apart"] > REAL_TOLD_APART
    assert {a.path for a in mlflow.MlflowClient().list_artifacts(r.info.run_id)} >= {"manifest.json",
                                                                                    "validation.md"}
    from slmsql.tracking import vocabulary

    assert not [k for k in r.data.metrics if not vocabulary.documented(k, "suite build")]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(DEV.read_text().splitlines()[0] + "\n{not json\n")
    refused = subprocess.run([*cmd[:7], "--data", str(bad), "--output-dir", str(tmp_path / "never")],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert refused.returncode == 2 and f"{bad}:2:" in refused.stderr and "malformed JSON" in refused.stderr
    assert not (tmp_path / "never").exists() and not (tmp_path / "never.partial").exists()
