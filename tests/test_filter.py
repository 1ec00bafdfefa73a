"""The filter stage: bucket accounting, a real run on the fixture policy, errors, resume after kill -9, bad input."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import mlflow
import pytest
import scripted
import torch
from click.testing import CliRunner
from driver_faults import killed_after
from neartie import DrawMargins
from policy import DB, foreign_adapter, policy_fixture, read, tracking_store, write  # noqa: F401  (the fixture)
import watched

from slmsql import configs
from slmsql.sql import passrates
from slmsql.stages import filter as passrate
from slmsql.cli import main as cli

K, LOW, HIGH = 8, 0.2, 0.8


# ---- bucket accounting on crafted rows -----------------------------------------------------------------

@pytest.mark.parametrize("n, expected", [
    (0, "all_fail"), (8, "all_pass"), (1, "1/8"), (7, "7/8"),
    (2, "band"), (3, "band"), (4, "band"), (5, "band"), (6, "band"),
])
def test_bucket_edges(n, expected):
    assert passrates.bucket(n, K, LOW, HIGH) == expected


def test_bucket_band_is_open():
    assert passrates.bucket(1, 4, 0.25, 0.75) == "1/4"  # on the bound: outside
    assert passrates.bucket(3, 4, 0.25, 0.75) == "3/4"
    assert passrates.bucket(2, 4, 0.25, 0.75) == "band"


def _row(i, n=None, error=False):
    if error:
        return {"id": f"q{i}", "k": K, "bucket": "errors", "error": "missing database"}
    return {"id": f"q{i}", "k": K, "n_correct": n, "pass_rate": n / K, "bucket": passrates.bucket(n, K, LOW, HIGH)}


def test_summarize_accounts_for_every_question():
    counts = [0, 0, 0, 1, 2, 3, 4, 4, 5, 6, 7, 7, 7, 8, 8]
    rows = [_row(i, n) for i, n in enumerate(counts)] + [_row(100, error=True), _row(101, error=True)]
    s = passrates.bucket_summary(rows, K, LOW, HIGH)
    b = s["buckets"]
    assert s["n_source"] == len(rows) == 17
    assert b == {"band": 6, "all_fail": 3, "all_pass": 2, "out_of_band": {"1/8": 1, "7/8": 3}, "errors": 2}
    assert list(b["out_of_band"]) == ["1/8", "7/8"]  # ordered by count, not as strings
    assert b["band"] + b["all_fail"] + b["all_pass"] + sum(b["out_of_band"].values()) + b["errors"] == s["n_source"]
    # the histogram counts scored questions only: errors are not 0/8
    assert s["histogram"] == {"0/8": 3, "1/8": 1, "2/8": 1, "3/8": 1, "4/8": 2, "5/8": 1, "6/8": 1, "7/8": 3,
                              "8/8": 2}
    assert sum(s["histogram"].values()) + b["errors"] == s["n_source"]
    assert s["error_ids"] == ["q100", "q101"]
    assert (s["k"], s["low"], s["high"]) == (K, LOW, HIGH)


def test_summarize_with_a_narrower_band():
    low, high = 0.3, 0.7  # 2/8 = 0.25 and 6/8 = 0.75 now fall outside: kept as out-of-band, not dropped
    rows = [{"id": f"q{n}", "k": K, "n_correct": n, "pass_rate": n / K, "bucket": passrates.bucket(n, K, low, high)}
            for n in range(K + 1)]
    s = passrates.bucket_summary(rows, K, low, high)
    assert s["buckets"]["out_of_band"] == {"1/8": 1, "2/8": 1, "6/8": 1, "7/8": 1}
    assert s["buckets"]["band"] == 3 and s["n_source"] == 9


# ---- a real filter run ----------------------------------------------------------------------------------

def filter_cfg(policy, data, out, **over):
    return configs.load(configs.FilterConfig, None, {
        "data": str(data), "db_root": str(policy.db_root), "model": str(policy.model), "output_dir": str(out),
        "k": 4, "max_new_tokens": 40, "workers": 1, "timeout_s": 2.0, **over})


def assert_rows_same_but_near_ties(draws, cfg, rows: list[dict], ref: list[dict]) -> None:
    """Pass-rate rows the same, question by question, but for a question one of whose K samples drew within
    DRAW_TIE of an edge (its statuses may then differ on another float path)."""
    from slmsql.runtime.seeds import sample_seed

    assert [r["id"] for r in rows] == [r["id"] for r in ref]
    parted = [r["id"] for r, o in zip(rows, ref) if r != o]
    bad = [q for q in parted if not any(draws.near_tie(sample_seed(cfg.seed, q, i)) for i in range(cfg.k))]
    assert not bad, f"rows differ where no sample drew near an edge: {bad}"


def pinned(rows) -> dict:
    """Three questions' samples, fixed: one in the band, one all-fail, one all-pass, whatever the policy samples."""
    return {rows[2]["id"]: [scripted.right(rows[2]), scripted.WRONG] * 2,
            rows[3]["id"]: [scripted.WRONG, scripted.NO_SQL] * 2,
            rows[4]["id"]: [scripted.right(rows[4])] * 4}


@pytest.fixture(scope="module")
def filtered(policy, tmp_path_factory):
    """One filter run (k=4) over the 40 source questions plus two that cannot be scored."""
    root = tmp_path_factory.mktemp("filter")
    rows = read(policy.source)
    missing_db = {**rows[0], "id": "no-db", "db_id": "no_such_db"}
    bad_gold = {**rows[1], "id": "bad-gold", "sql": "SELECT no_such_column FROM patient"}
    data = write(root / "source.jsonl", rows + [missing_db, bad_gold])
    uri = f"sqlite:///{root}/mlflow.db"
    with tracking_store(uri), pytest.MonkeyPatch.context() as mp:
        # the policy samples the rest; these three are pinned, so band, all-fail and all-pass are never empty
        scripted.pin(mp, completions=pinned(rows))
        summary = passrate.main(filter_cfg(policy, data, root / "out"))
    return root / "out", data, summary, uri


def test_filter_files_are_consistent(filtered):
    out, data, summary, _ = filtered
    source = {r["id"]: r for r in read(data)}
    assert sorted(p.name for p in out.iterdir()) == ["band.jsonl", "passrates.jsonl", "summary.json"]
    assert not out.with_name("out.partial").exists()

    rates = read(out / "passrates.jsonl")
    assert [r["id"] for r in rates] == list(source)  # every source question, in source order
    for r in rates:
        if r["bucket"] == "errors":
            continue
        assert len(r["statuses"]) == 4 and r["k"] == 4
        assert r["n_correct"] == r["statuses"].count("correct")
        assert r["pass_rate"] == r["n_correct"] / 4
        assert r["bucket"] == passrates.bucket(r["n_correct"], 4, 0.2, 0.8)

    band = read(out / "band.jsonl")
    pinned = [source[list(source)[i]]["id"] for i in (2, 3, 4)]
    assert pinned[0] in {r["id"] for r in band}  # 2 of 4 right
    by_id = {r["id"]: r for r in rates}
    assert (by_id[pinned[1]]["bucket"], by_id[pinned[1]]["statuses"]) == ("all_fail", ["wrong_result", "no_sql"] * 2)
    assert (by_id[pinned[2]]["bucket"], by_id[pinned[2]]["n_correct"]) == ("all_pass", 4)
    by_id = {r["id"]: r for r in rates}
    for row in band:
        assert by_id[row["id"]]["bucket"] == "band"
        assert row["k"] == 4 and 0.2 < row["pass_rate"] < 0.8
        assert row["pass_rate"] == row["n_correct"] / 4 == by_id[row["id"]]["pass_rate"]
        src = source[row["id"]]  # the gold row travels unchanged, pass rate added
        assert {k: row[k] for k in src} == src
    assert {r["id"] for r in band} == {r["id"] for r in rates if r["bucket"] == "band"}

    s = json.loads((out / "summary.json").read_text())
    assert s == summary
    b = s["buckets"]
    assert s["n_source"] == len(source) == 42
    assert b["band"] == len(band)
    assert b["band"] + b["all_fail"] + b["all_pass"] + sum(b["out_of_band"].values()) + b["errors"] == 42
    assert sum(s["histogram"].values()) + b["errors"] == 42


def test_filter_errors_bucket(filtered):
    out, _, summary, _ = filtered
    rates = {r["id"]: r for r in read(out / "passrates.jsonl")}
    assert summary["buckets"]["errors"] == 2
    assert sorted(summary["error_ids"]) == ["bad-gold", "no-db"]
    assert rates["no-db"]["bucket"] == "errors" and rates["no-db"]["error"] == "missing database"
    assert rates["bad-gold"]["bucket"] == "errors" and "no_such_column" in rates["bad-gold"]["error"]
    assert "n_correct" not in rates["bad-gold"]


def test_filter_mlflow_run(filtered):
    out, _, summary, uri = filtered
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["slmsql.stage"] == "filter"
    m, b = run.data.metrics, summary["buckets"]
    assert m["n_source"] == 42
    assert (m["band"], m["all_fail"], m["all_pass"], m["errors"]) == (b["band"], b["all_fail"], b["all_pass"], 2)
    assert m["out_of_band"] == sum(b["out_of_band"].values())
    assert m["data_check_success"] == 1.0
    assert run.data.params["k"] == "4"
    names = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"band.jsonl", "passrates.jsonl", "summary.json", "pass_rate_histogram.png", "data_check"} <= names
    assert [f.path for f in client.list_artifacts(run.info.run_id, "data_check")] == ["data_check/rl.json"]
    report = json.loads(Path(client.download_artifacts(run.info.run_id, "data_check/rl.json")).read_text())
    assert report["success"] is True
    assert "system/cpu_utilization_percentage" in m and "system/system_memory_usage_megabytes" in m
    note = run.data.tags["mlflow.note.content"]  # the description states the buckets
    assert note.startswith(f"Pass rates of 42 questions from K = 4 samples each: band (0.2 < p < 0.8) {b['band']}, "
                           f"all fail (0/4) {b['all_fail']}, all pass (4/4) {b['all_pass']}, out of band "
                           f"{sum(b['out_of_band'].values())}")
    assert "errors 2." in note
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.name == "rl"  # as GRPO names its input
    assert [t.value for t in inp.tags if t.key == "mlflow.data.context"] == ["output"]
    assert json.loads(inp.dataset.profile)["num_rows"] == b["band"]


def test_pass_rates_do_not_depend_on_chunks_or_batches(policy, filtered, tmp_path, monkeypatch):
    """Samples are seeded by (seed, question id, sample index): rounds of 5 questions generated 3 prompts at a
    time give every question the same K statuses as rounds of 32 at 16 (the fixture), so the same rows,
    pass rates and buckets, but where a draw fell at a near-tie (other batches are another float path:
    tests/neartie.py). (Ray's shards are one more partitioning: tests/test_ray.py.)"""
    out, data, _, _ = filtered
    scripted.pin(monkeypatch, completions=pinned(read(policy.source)))  # as the fixture's run
    monkeypatch.setattr(passrate, "CHUNK", 5)
    draws = DrawMargins(monkeypatch)
    cfg = filter_cfg(policy, data, tmp_path / "out", batch_size=3)
    passrate.main(cfg)
    rows = read(tmp_path / "out" / "passrates.jsonl")
    assert_rows_same_but_near_ties(draws, cfg, rows, read(out / "passrates.jsonl"))
    assert {2, 0, 4} <= {r.get("n_correct") for r in rows}  # the pinned spread: band, all-fail, all-pass


# ---- resume after kill -9 -------------------------------------------------------------------------------

def test_filter_resumes_after_kill(policy, tmp_path, monkeypatch, request):
    """kill -9 right after the first chunk is written (tests/driver_faults.py: at a row count the test picks, no
    polling race); the rerun keeps finished chunks, continues the same MLflow run, and ends with exactly what an
    uninterrupted run writes."""
    rl = read(policy.world / "rl_source.jsonl")
    own = read(policy.train) + [r for r in rl if r["db_id"] == DB]  # 60 questions: the band comes from here
    other = [r for r in rl if r["db_id"] != DB]
    data = write(tmp_path / "source.jsonl", own + other[:128 - len(own)])  # 4 chunks of 32
    out = tmp_path / "out"
    args = ["filter", "--data", str(data), "--db-root", str(policy.db_root), "--model", str(policy.model),
            "--output-dir", str(out), "--k", "2", "--max-new-tokens", "32", "--workers", "1", "--timeout-s", "2"]
    partial = tmp_path / "out.partial" / "passrates.jsonl"

    # one thread in every process here (the killed run, the resumed run, the reference in this one), over the
    # same chunks: the same computation, so the same samples on any machine (thread counts are float paths)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    killed = killed_after(passrates.CHUNK, args)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    rows = read(partial)  # killed after the rows were written and synced: no torn line
    assert len(rows) == passrates.CHUNK and not out.exists()
    write(partial, [{**r, "mark": True} for r in rows])  # a rerun that sampled them again would drop the mark
    kept = len(rows)

    cmd = [sys.executable, "-c", "from slmsql.cli import main; main()", *args]
    resumed = watched.run(cmd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = read(out / "passrates.jsonl")
    assert [r.get("mark", False) for r in final] == [True] * kept + [False] * (128 - kept)

    client = mlflow.MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])
    assert len(runs) == 1, "the rerun must continue the killed run, not start a second one"
    assert runs[0].info.status == "FINISHED" and runs[0].data.metrics["n_source"] == 128

    # An uninterrupted run with the same parameters writes the same rows.
    ref = tmp_path / "ref"
    with tracking_store(f"sqlite:///{tmp_path}/ref.db"):
        passrate.main(configs.load(configs.FilterConfig, None, {
            "data": str(data), "db_root": str(policy.db_root), "model": str(policy.model), "output_dir": str(ref),
            "k": 2, "max_new_tokens": 32, "workers": 1, "timeout_s": 2.0}))
    assert [{k: v for k, v in r.items() if k != "mark"} for r in final] == read(ref / "passrates.jsonl")
    assert (out / "band.jsonl").read_text() == (ref / "band.jsonl").read_text()


# ---- bad input ------------------------------------------------------------------------------------------

def _run_cli(policy, out, **opts):
    args = ["filter", "--db-root", str(policy.db_root), "--output-dir", str(out), "--k", "2"]
    for k, v in {"data": policy.source, "model": policy.model, **opts}.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return CliRunner().invoke(cli, args)


def test_filter_unknown_model_path(policy, tmp_path):
    result = _run_cli(policy, tmp_path / "out", model=tmp_path / "no" / "such-model")
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and "no/such-model" in result.output and "not found" in result.output
    # nothing a corrected rerun would trip over: no folder to resume, no failed run
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    assert [e.name for e in mlflow.MlflowClient().search_experiments()] in ([], ["Default"])


def test_filter_adapter_for_another_base(policy, tmp_path):
    adapter = foreign_adapter(tmp_path)
    result = _run_cli(policy, tmp_path / "out", adapter=adapter)
    assert result.exit_code == 2, result.output
    assert "was trained on base model" in result.output and str(policy.model) in result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_filter_empty_source(policy, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    result = _run_cli(policy, tmp_path / "out", data=empty)
    assert result.exit_code == 2, result.output
    assert "empty.jsonl" in result.output and "empty" in result.output.split("empty.jsonl", 1)[1]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


# ---- text UTF-8 cannot encode ---------------------------------------------------------------------------

ODD = "\ud800"  # a lone surrogate: what a JSON "\ud800" escape decodes to; UTF-8 has no bytes for it


@pytest.mark.slow
def test_filter_with_text_utf8_cannot_encode(shop, tmp_path, monkeypatch):
    """Completions and gold text holding a lone surrogate: the run finishes and every file reads back.

    (Completion text alone never reaches a filter file, only its status; the gold row does, in band.jsonl.)"""
    from slmsql.generation import sampling as generation
    from slmsql.policy import models
    from slmsql.toy.tiny_model import build_tiny_model
    from slmsql.inputs.data import read_jsonl

    gold = "SELECT name FROM item WHERE kind = 'office'"
    question = f"Office items {ODD}?"
    data = tmp_path / "source.jsonl"  # raw JSON text: the escape, as a user's file would carry it
    data.write_text(json.dumps({"id": "q1", "db_id": "shop", "question": question, "sql": gold}) + "\n")
    assert "\\ud800" in data.read_text()

    def complete(cfg, examples, policy, *, k, **_):  # half right: the question lands in the band
        return [[f"```sql\n{gold}\n```", f"```sql\nSELECT '{ODD}'\n```"] * (k // 2) for _ in examples]

    # a real tokenizer (the prompts are counted before sampling); the weights are never loaded
    tiny = build_tiny_model(tmp_path / "tiny", ["Office items", gold], vocab_size=300, hidden=16, layers=1, heads=2,
                                   ffn=32)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(generation, "complete", complete)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["filter", "--data", str(data), "--db-root", str(shop), "--model", str(tiny),
                                      "--output-dir", str(out), "--k", "4", "--workers", "1", "--min-band", "1"])
    assert result.exit_code == 0, result.output
    (rate,) = read_jsonl(out / "passrates.jsonl")
    assert (rate["bucket"], rate["n_correct"], rate["statuses"]) == ("band", 2, ["correct", "error"] * 2)
    (row,) = read_jsonl(out / "band.jsonl")
    assert row["question"] == question  # the exact string, lone surrogate included
    (run,) = mlflow.search_runs(experiment_names=["slmsql"], output_format="list")
    assert run.info.status == "FINISHED" and run.data.metrics["data_check_success"] == 1.0
