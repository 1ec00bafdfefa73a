"""Data checks: each suite passes on a good world and each expectation fails on a copy broken for it."""

import copy
import json
import sqlite3

import pytest

from slmsql.checks import datachecks as checks
from slmsql.errors import DataError, SlmsqlError

K = 10  # with K=10, 0.2 and 0.8 are reachable pass rates: the band's edges can be hit exactly


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Two databases, a consistent band of 6 questions, its summary, and a disjoint eval set."""
    root = tmp_path_factory.mktemp("world")
    dbs = root / "dbs"
    for db in ("shop", "zoo"):
        (dbs / db).mkdir(parents=True)
        con = sqlite3.connect(dbs / db / f"{db}.sqlite")
        con.executescript("CREATE TABLE t (a INTEGER, b TEXT); INSERT INTO t VALUES (1, 'x'), (2, 'y');")
        con.close()
    band = [{"id": f"q{i}", "db_id": ("shop", "zoo")[i % 2], "question": f"How many rows have a above {i}?",
             "sql": f"SELECT count(*) FROM t WHERE a > {i}", "difficulty": "simple",
             "pass_rate": n / K, "k": K, "n_correct": n} for i, n in enumerate([3, 4, 5, 6, 7, 4])]
    summary = {"n_source": 20, "k": K, "low": 0.2, "high": 0.8,
               "buckets": {"band": 6, "all_fail": 5, "all_pass": 4,
                           "out_of_band": {"1/10": 1, "2/10": 1, "8/10": 1}, "errors": 2},
               "histogram": {f"{i}/{K}": n for i, n in enumerate([5, 1, 1, 1, 2, 1, 1, 1, 1, 0, 4])},
               "error_ids": ["e1", "e2"]}
    evalset = [{"id": "e1", "db_id": "shop", "question": "List every b.", "sql": "SELECT b FROM t",
                "difficulty": "simple"},
               {"id": "e2", "db_id": "zoo", "question": "What is the largest a?", "sql": "SELECT max(a) FROM t",
                "difficulty": "challenging"},
               {"id": "e3", "db_id": "zoo", "question": "Count the rows.", "sql": "SELECT count(*) FROM t"}]
    return {"dbs": dbs, "band": band, "summary": summary, "eval": evalset}


def write(tmp_path, world, band=None, summary=None, evalset=None):
    files = {"band": tmp_path / "band.jsonl", "summary": tmp_path / "summary.json", "eval": tmp_path / "eval.jsonl"}
    files["band"].write_text("".join(json.dumps(r) + "\n" for r in band or world["band"]))
    files["summary"].write_text(json.dumps(summary or world["summary"]))
    files["eval"].write_text("".join(json.dumps(r) + "\n" for r in evalset or world["eval"]))
    return files


def rl(files, world, **kw):
    return checks.validate("rl", files["band"], world["dbs"], summary=files["summary"],
                           eval_sets=[files["eval"]], **kw)


def failed(report):
    return {r["expectation"] for r in report.failed}


def test_rl_suite_passes_on_the_good_world(tmp_path, world, caplog):
    caplog.set_level("INFO")
    report = rl(write(tmp_path, world), world)
    assert not [r for r in caplog.records if r.name.startswith("great_expectations")]  # GX kept quiet
    assert report.success, report.failure_message()
    assert report.skipped == [] and report.n_rows == 6
    names = {r["expectation"] for r in report.results}
    assert {"pass_rate_in_band", "k_constant", "pass_rate_matches_counts", "ids_unique", "database_exists",
            "gold_executes", "not_in_eval_set", "summary_buckets_add_up", "summary_band_matches_file"} <= names
    json.dumps(report.to_json())  # plain JSON: no numpy scalars left in it


def _set(i, **values):
    def mutate(band, summary, evalset):
        band[i].update(values)
    return mutate


def _summary(path, value):
    def mutate(band, summary, evalset):
        d = summary
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value
    return mutate


def _drop_row(band, summary, evalset):
    del band[-1]


def _share_question(band, summary, evalset):
    # Same database, same question up to case and spacing: a leak of an eval question into RL data.
    evalset.append({"id": "e9", "db_id": band[3]["db_id"], "question": "  how many ROWS have a  above 3? ",
                    "sql": "SELECT 1"})


MUTATIONS = {
    "pass_rate at low": (_set(0, n_correct=2, pass_rate=0.2), {"pass_rate_in_band"}),
    "pass_rate at high": (_set(0, n_correct=8, pass_rate=0.8), {"pass_rate_in_band"}),
    "k differs on one row": (_set(1, k=5, n_correct=2, pass_rate=0.4), {"k_constant"}),
    "n_correct/k != pass_rate": (_set(2, n_correct=3), {"pass_rate_matches_counts"}),
    "duplicate id": (_set(3, id="q2"), {"ids_unique"}),
    "missing database": (_set(4, db_id="ghost"), {"database_exists", "gold_executes"}),
    "gold fails to execute": (_set(5, sql="SELECT nope FROM t"), {"gold_executes"}),
    "question shared with eval set": (_share_question, {"not_in_eval_set"}),
    "buckets do not add up": (_summary(("buckets", "all_fail"), 6), {"summary_buckets_add_up"}),
    "band count != file rows": (_drop_row, {"summary_band_matches_file"}),
    "histogram does not add up": (_summary(("histogram", "0/10"), 4), {"summary_histogram_adds_up"}),
    "summary from another band": (_summary(("low",), 0.1), {"summary_band_bounds"}),
    "missing question": (_set(0, question=None), {"question_not_null"}),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_rl_expectation_fails_on_its_broken_copy(tmp_path, world, name):
    mutate, expected = MUTATIONS[name]
    band, summary, evalset = (copy.deepcopy(world[k]) for k in ("band", "summary", "eval"))
    mutate(band, summary, evalset)
    report = rl(write(tmp_path, world, band, summary, evalset), world)
    assert not report.success
    assert failed(report) == expected
    for r in report.failed:
        assert r["examples"], r  # every failure shows what broke it


def test_failure_examples_name_the_row_and_the_value(tmp_path, world):
    band = copy.deepcopy(world["band"])
    band[0].update(n_correct=2, pass_rate=0.2)
    band[5]["sql"] = "SELECT nope FROM t"
    report = rl(write(tmp_path, world, band), world)
    by_name = {r["expectation"]: r for r in report.results}
    assert by_name["pass_rate_in_band"]["unexpected_count"] == 1
    assert by_name["pass_rate_in_band"]["examples"] == [{"line": 1, "id": "q0", "pass_rate": 0.2}]
    (ex,) = by_name["gold_executes"]["examples"]
    assert ex["id"] == "q5" and "no such column: nope" in ex["detail"]
    md = report.to_markdown()
    assert "pass_rate_in_band" in md and "FAIL" in md and "(0.2, 0.8)" in md
    msg = report.failure_message()
    assert "pass_rate_in_band" in msg and "'q0'" in msg and "gold_executes" in msg


def test_db_id_that_is_a_path_fails_database_exists(tmp_path, world):
    band = copy.deepcopy(world["band"])
    band[2]["db_id"] = "../dbs/shop"
    report = rl(write(tmp_path, world, band), world)
    assert failed(report) == {"database_exists", "gold_executes"}
    (ex,) = {r["expectation"]: r for r in report.results}["database_exists"]["examples"]
    assert ex["id"] == "q2" and "'../dbs/shop' is not a database name" in ex["detail"]


def test_band_file_without_pass_rate_fails_instead_of_crashing(tmp_path, world):
    band = [{k: v for k, v in r.items() if k not in ("pass_rate", "k", "n_correct")} for r in world["band"]]
    report = checks.validate("rl", write(tmp_path, world, band)["band"], world["dbs"])
    assert {"required_columns", "pass_rate_in_band", "k_constant", "pass_rate_matches_counts"} <= failed(report)
    by_name = {r["expectation"]: r for r in report.results}
    assert by_name["required_columns"]["examples"] == [{"missing_columns": ["k", "n_correct", "pass_rate"]}]
    assert "pass_rate" in by_name["pass_rate_in_band"]["error"]


def test_without_summary_or_eval_sets_those_checks_are_skipped(tmp_path, world):
    files = write(tmp_path, world)
    report = checks.run_rl_check(files["band"], world["dbs"], None, 0.2, 0.8)
    assert report.success
    assert {s["expectation"] for s in report.skipped} == {
        "not_in_eval_set", "summary_buckets_add_up", "summary_band_matches_file", "summary_histogram_adds_up",
        "summary_band_bounds"}
    assert "skipped" in report.to_markdown()


def test_empty_band_file_fails_only_its_size(tmp_path, world):
    (tmp_path / "band.jsonl").write_text("")
    report = checks.validate("rl", tmp_path / "band.jsonl", world["dbs"])
    assert failed(report) == {"not_empty", "band_fills_a_grpo_step"}  # the columns are there, every row fine


def test_unreadable_input_is_a_data_error_naming_file_and_line(tmp_path, world):
    files = write(tmp_path, world)
    lines = files["band"].read_text().splitlines()
    lines[2] = '{"id": "q2", "db_id": '
    files["band"].write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as e:
        checks.validate("rl", files["band"], world["dbs"])
    assert e.value.line == 3 and str(files["band"]) in str(e.value)

    files = write(tmp_path, world)
    files["summary"].write_text('{"n_source": 20,\n "buckets": ')
    with pytest.raises(DataError, match="summary.json:2"):
        rl(files, world)
    bad = copy.deepcopy(world["summary"])
    bad["buckets"]["errors"] = "two"
    with pytest.raises(DataError, match="buckets.errors"):
        rl(write(tmp_path, world, summary=bad), world)
    with pytest.raises(SlmsqlError, match="low < high"):
        rl(write(tmp_path, world), world, low=0.8, high=0.2)


def test_a_broken_suite_file_is_named(tmp_path, world, monkeypatch):
    suite = json.loads((checks.suites_dir() / "eval.json").read_text())
    monkeypatch.setenv("SLMSQL_DATA_CHECKS", str(tmp_path))
    suite["expectations"][0]["type"] = "expect_no_such_thing"
    (tmp_path / "eval.json").write_text(json.dumps(suite))
    with pytest.raises(DataError, match="eval.json"):
        checks.validate("eval", write(tmp_path, world)["eval"], world["dbs"])
    suite["expectations"][0].pop("description")
    (tmp_path / "eval.json").write_text(json.dumps(suite))
    with pytest.raises(DataError, match=r"expectations\[0\]"):
        checks.load_suite("eval")


# ------------------------------------------------------------------------------------------------ eval
def test_eval_suite(tmp_path, world):
    files = write(tmp_path, world)
    good = checks.validate("eval", files["eval"], world["dbs"])
    assert good.success, good.failure_message()

    bad = copy.deepcopy(world["eval"])
    bad[0]["difficulty"] = "hard"
    bad[1]["sql"] = "SELECT max(nope) FROM t"
    bad[2]["question"] = "   "
    report = checks.validate("eval", write(tmp_path, world, evalset=bad)["eval"], world["dbs"])
    assert failed(report) == {"difficulty_known", "gold_executes", "question_not_blank"}
    by_name = {r["expectation"]: r for r in report.results}
    assert by_name["difficulty_known"]["examples"] == [{"line": 1, "id": "e1", "difficulty": "hard"}]
    assert by_name["gold_executes"]["examples"][0]["id"] == "e2"


def test_eval_suite_reads_spider_dev_json_natively(tmp_path, world):
    # Spider: no ids (the position is the id), `query` instead of `sql`, no difficulty at all.
    dev = [{"db_id": "shop", "question": "How many rows?", "query": "SELECT count(*) FROM t"},
           {"db_id": "zoo", "question": "Smallest a?", "query": "SELECT min(a) FROM t"}]
    (tmp_path / "dev.json").write_text(json.dumps(dev))
    report = checks.validate("eval", tmp_path / "dev.json", world["dbs"])
    assert report.success, report.failure_message()
    dev.append({"db_id": "nowhere", "question": "?", "query": "SELECT 1"})
    (tmp_path / "dev.json").write_text(json.dumps(dev))
    report = checks.validate("eval", tmp_path / "dev.json", world["dbs"])
    assert failed(report) == {"database_exists", "gold_executes"}
    assert report.failed[0]["examples"][0]["line"] == 2  # JSON arrays: the record index


# ------------------------------------------------------------------------------------------------- CLI
def test_cli_validate_exits_0_on_good_and_2_on_bad(tmp_path, world):
    import mlflow
    from click.testing import CliRunner

    from slmsql.cli import main

    files = write(tmp_path, world)
    args = ["validate", "--kind", "rl", "--data", str(files["band"]), "--db-root", str(world["dbs"]),
            "--summary", str(files["summary"]), "--eval-sets", str(files["eval"])]
    good = CliRunner().invoke(main, [*args, "--output-dir", str(tmp_path / "good")])
    assert good.exit_code == 0, good.output
    assert json.loads((tmp_path / "good" / "validation.json").read_text())["success"] is True

    band = copy.deepcopy(world["band"])
    band[0].update(n_correct=2, pass_rate=0.2)
    bad_dir = tmp_path / "bad_input"
    bad_dir.mkdir()
    bad_files = write(bad_dir, world, band)
    bad_args = [a if a != str(files["band"]) else str(bad_files["band"]) for a in args]
    bad = CliRunner().invoke(main, [*bad_args, "--output-dir", str(tmp_path / "bad")])
    assert bad.exit_code == 2, bad.output
    assert "pass_rate_in_band" in bad.output and "'q0'" in bad.output
    # The report of a failed check is kept, complete, under the final name.
    report = json.loads((tmp_path / "bad" / "validation.json").read_text())
    assert report["success"] is False
    assert "pass_rate_in_band" in (tmp_path / "bad" / "validation.md").read_text()

    runs = mlflow.search_runs(search_all_experiments=True, order_by=["start_time ASC"])
    assert list(runs["metrics.success"]) == [1.0, 0.0]
    assert list(runs["metrics.n_failed"]) == [0.0, 1.0]
    assert list(runs["status"]) == ["FINISHED", "FAILED"]
    n = len(json.loads((tmp_path / "good" / "validation.json").read_text())["results"])
    assert list(runs["tags.mlflow.note.content"]) == [  # the description states the verdict, failed or not
        f"rl data check PASSED: all {n} expectations on {len(world['band'])} rows of band.jsonl.",
        f"rl data check FAILED: 1 of {n} expectations (pass_rate_in_band) on {len(world['band'])} rows of band.jsonl."]
    client = mlflow.MlflowClient()
    for run_id in runs["run_id"]:
        assert {a.path for a in client.list_artifacts(run_id)} == {"validation.json", "validation.md"}
