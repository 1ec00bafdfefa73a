"""SFT (LoRA, full, continuing an adapter) and evaluation with a model (greedy, rescoring, baseline runs)."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
import scripted
import torch
from click.testing import CliRunner
from policy import foreign_adapter, policy_fixture, read, tracking_store  # noqa: F401  (the fixture)
from safetensors.torch import load_file

from slmsql import configs
from slmsql.generation import sampling as generation
from slmsql.policy import models
from slmsql.stages import evaluate, sft
from slmsql.cli import main as cli
from slmsql.errors import SlmsqlError
from slmsql.sql.extract import extract_sql

# ---- SFT ------------------------------------------------------------------------------------------------


def sft_args(policy, out, *extra):
    return ["sft", "--data", str(policy.train), "--db-root", str(policy.db_root), "--model", str(policy.tiny),
            "--output-dir", str(out), "--max-steps", "4", "--per-device-train-batch-size", "4", *extra]


@pytest.fixture(scope="module")
def lora(policy, tmp_path_factory):
    """`slmsql sft --use-lora true` on the untrained tiny base, then a second SFT continuing that adapter."""
    root = tmp_path_factory.mktemp("sft")
    uri = f"sqlite:///{root}/mlflow.db"
    with tracking_store(uri):
        first = CliRunner().invoke(cli, sft_args(policy, root / "lora", "--use-lora", "true", "--lora-r", "4",
                                                 "--lora-alpha", "8", "--run-name", "lora"))
        assert first.exit_code == 0, first.output
        again = CliRunner().invoke(cli, sft_args(policy, root / "continued", "--base-adapter", str(root / "lora"),
                                                 "--run-name", "continued"))
        assert again.exit_code == 0, again.output
    client = mlflow.MlflowClient(uri)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])}
    return root, client, runs


def test_sft_lora_saves_a_loadable_adapter(lora, policy):
    root, _, _ = lora
    out = root / "lora"
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "sft_summary.json"} <= names
    assert "model.safetensors" not in names  # an adapter, not a copy of the base
    assert not (out / "checkpoints").exists()  # no intermediate checkpoints kept
    assert not (root / "lora.partial").exists()
    config = json.loads((out / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]).resolve() == policy.tiny.resolve() and config["r"] == 4
    summary = json.loads((out / "sft_summary.json").read_text())
    assert summary["kind"] == "adapter" and summary["steps"] == 4 and summary["examples"] == 47
    model, tokenizer = models.load_model(policy.tiny, out)
    assert type(model).__name__.startswith("Peft") and tokenizer.padding_side == "left"
    weights = load_file(out / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in weights.items())  # trained: B starts at zero


def test_sft_lora_mlflow_run(lora, policy):
    _, client, runs = lora
    run = runs["lora"]
    assert run.info.status == "FINISHED" and run.data.tags["slmsql.stage"] == "sft"
    assert run.data.tags["slmsql.policy_kind"] == "adapter"
    m = run.data.metrics
    assert {"loss", "grad_norm", "learning_rate", "train_loss", "steps", "train_seconds"} <= set(m)
    assert m["steps"] == 4 and m["train_loss"] > 0
    assert sorted(h.step for h in client.get_metric_history(run.info.run_id, "loss")) == [1, 2, 3, 4]
    assert run.data.params["use_lora"] == "true" and run.data.params["max_steps"] == "4"
    policy_files = {f.path for f in client.list_artifacts(run.info.run_id, "policy")}
    assert {"policy/adapter_config.json", "policy/adapter_model.safetensors", "policy/tokenizer.json",
            "policy/sft_summary.json"} <= policy_files
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.name == "sft" and json.loads(inp.dataset.profile)["num_rows"] == 47
    assert run.data.tags["mlflow.note.content"].startswith(
        f"SFT (LoRA adapter) of {policy.tiny}: 4 steps on 47 examples in ")
    assert f"train loss {m['train_loss']:.3g}." in run.data.tags["mlflow.note.content"]
    assert "policy/README.md" not in policy_files  # PEFT's placeholder card is not logged with the adapter


def test_sft_base_adapter_continues_it(lora, policy):
    root, _, runs = lora
    before = load_file(root / "lora" / "adapter_model.safetensors")
    after = load_file(root / "continued" / "adapter_model.safetensors")
    assert before.keys() == after.keys()  # the same adapter trained further, not a new one stacked on it
    assert any(not torch.equal(before[k], after[k]) for k in before)
    config = json.loads((root / "continued" / "adapter_config.json").read_text())
    assert config["r"] == 4 and Path(config["base_model_name_or_path"]).resolve() == policy.tiny.resolve()
    run = runs["continued"]
    assert run.data.tags["slmsql.base_adapter"] == str(root / "lora")
    assert run.data.tags["slmsql.policy_kind"] == "adapter"
    models.load_model(policy.tiny, root / "continued")


def test_sft_full_saves_a_model(policy, tmp_path):
    cfg = configs.load(configs.SFTStageConfig, None, {
        "data": str(policy.train), "db_root": str(policy.db_root), "model": str(policy.tiny),
        "output_dir": str(tmp_path / "full"), "max_steps": 3, "per_device_train_batch_size": 4})
    summary = sft.main(cfg)
    out = tmp_path / "full"
    assert summary["kind"] == "full" and summary["steps"] == 3
    assert (out / "model.safetensors").exists() and not (out / "adapter_config.json").exists()
    trained, _ = models.load_model(out)
    base, _ = models.load_model(policy.tiny)
    assert trained.config.hidden_size == base.config.hidden_size
    assert not torch.equal(trained.model.embed_tokens.weight, base.model.embed_tokens.weight)
    client = mlflow.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])
    assert run.data.tags["slmsql.policy_kind"] == "full"
    assert "policy/model.safetensors" in {f.path for f in client.list_artifacts(run.info.run_id, "policy")}


def test_sft_base_adapter_for_another_base(policy, tmp_path, monkeypatch):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    result = CliRunner().invoke(cli, sft_args(policy, tmp_path / "out", "--base-adapter",
                                              str(foreign_adapter(tmp_path))))
    assert result.exit_code == 2 and "was trained on base model" in result.output, result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


# ---- evaluate with a model ------------------------------------------------------------------------------

def eval_cfg(policy, out, **over):
    return configs.load(configs.EvaluateConfig, None, {
        "data": str(policy.dev), "db_root": str(policy.db_root), "output_dir": str(out), "max_new_tokens": 48,
        "workers": 1, "timeout_s": 2.0, **over})


@pytest.fixture(scope="module")
def evals(policy, tmp_path_factory):
    """Greedy evaluation of the policy twice (the second against the first as baseline), a rescoring of the
    first one's predictions file, and an oracle predictions file (the gold SQL) against the same baseline."""
    root = tmp_path_factory.mktemp("evaluate")
    uri = f"sqlite:///{root}/mlflow.db"
    oracle = root / "oracle.jsonl"
    oracle.write_text("".join(json.dumps({"id": r["id"], "sql": r["sql"]}) + "\n" for r in read(policy.dev)))
    dev = read(policy.dev)
    # The policy answers the rest greedily; pinned: one right answer and six wrong ones, so EX is neither 0 nor
    # 1 and the oracle's gain is significant (6 discordant pairs: p = 0.03) on any machine.
    pinned = {dev[0]["id"]: scripted.right(dev[0]), **{r["id"]: scripted.WRONG for r in dev[-6:]}}
    with tracking_store(uri), pytest.MonkeyPatch.context() as mp:
        scripted.pin(mp, answers=pinned)
        first = evaluate.main(eval_cfg(policy, root / "a", model=str(policy.model), run_name="a"))
        client = mlflow.MlflowClient(uri)
        (run_a,) = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])
        a_id = run_a.info.run_id
        second = evaluate.main(eval_cfg(policy, root / "b", model=str(policy.model), run_name="b", baseline_run=a_id))
        rescored = evaluate.main(eval_cfg(policy, root / "c", predictions=str(root / "a" / "predictions.jsonl"),
                                          run_name="c"))
        best = evaluate.main(eval_cfg(policy, root / "d", predictions=str(oracle), run_name="d", baseline_run=a_id))
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])}
    return root, uri, client, runs, {"a": first, "b": second, "c": rescored, "d": best}


def test_greedy_evaluation_is_deterministic(evals):
    root, *_ = evals
    preds = (root / "a" / "predictions.jsonl").read_text()
    assert preds == (root / "b" / "predictions.jsonl").read_text()
    rows = [json.loads(line) for line in preds.splitlines()]
    assert len(rows) == 30 and all(set(r) >= {"id", "completion", "sql", "extracted_by"} for r in rows)
    assert all(isinstance(r["completion"], str) for r in rows)
    # each prediction's SQL is what extraction finds in its completion (how many hold a ```sql block is the
    # policy's float-dependent behaviour: not asserted)
    assert all((r["sql"], r["extracted_by"]) == extract_sql(r["completion"]) for r in rows)
    timeless = lambda rows: [{k: v for k, v in r.items() if k != "pred_ms"} for r in rows]  # noqa: E731
    assert timeless(read(root / "a" / "results.jsonl")) == timeless(read(root / "b" / "results.jsonl"))


def as_logged(value: float) -> float:
    """An evaluation statistic as its run logs it: rounded to tracking.STAT_DIGITS (6) significant digits, so
    the run page shows 0.333333, not 0.3333333333333333. metrics.json keeps the unrounded value: the two are
    equal only for scores whose decimal expansion is short (9/30, not 10/30), which depends on the machine."""
    from slmsql.tracking.runs import STAT_DIGITS

    return float(f"{value:.{STAT_DIGITS}g}")


def test_as_logged_is_six_significant_digits():
    assert as_logged(10 / 30) == 0.333333 and as_logged(9 / 30) == 0.3 and as_logged(0.0291388944) == 0.0291389


def test_evaluation_metrics_and_run(evals):
    root, _, client, runs, m = evals
    a = m["a"]
    results = read(root / "a" / "results.jsonl")
    assert a["n"] == 30 and a["n_correct"] == sum(r["correct"] for r in results)
    assert 0 < a["ex"] < 1  # pinned: one right, six wrong
    assert json.loads((root / "a" / "metrics.json").read_text()) == a
    run = runs["a"]
    assert run.info.status == "FINISHED"
    assert run.data.tags["slmsql.dataset"] == "dev" and run.data.tags["slmsql.match"] == "bird"
    assert run.data.metrics["ex"] == as_logged(a["ex"])
    for key in ("ex_ci_low", "ex_ci_high", "n", "n_correct"):
        assert run.data.metrics[key] == as_logged(a[key]), key
    names = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"results.jsonl", "metrics.json", "predictions.jsonl", "ex_intervals.png", "results_table.json"} <= names
    assert "disagreements_table.json" not in names  # no baseline, no pairs
    (inp,) = run.inputs.dataset_inputs  # the eval set, under its dataset name
    assert inp.dataset.name == "dev" and json.loads(inp.dataset.profile)["num_rows"] == 30
    assert [t.value for t in inp.tags if t.key == "mlflow.data.context"] == ["evaluation"]
    lo, hi = a["ex_ci_low"], a["ex_ci_high"]
    assert run.data.tags["mlflow.note.content"] == (f"EX {100 * a['ex']:.1f}% (95% Wilson interval {100 * lo:.1f}% "
                                                    f"to {100 * hi:.1f}%) on 30 questions of dev, bird match.")


def test_rescoring_predictions_gives_the_same_ex(evals):
    root, _, _, runs, m = evals
    assert m["c"]["ex"] == m["a"]["ex"] and m["c"]["n_correct"] == m["a"]["n_correct"]
    by_model = {r["id"]: r["correct"] for r in read(root / "a" / "results.jsonl")}
    assert {r["id"]: r["correct"] for r in read(root / "c" / "results.jsonl")} == by_model
    assert runs["c"].data.tags["slmsql.model"] == "predictions-file"
    assert not (root / "c" / "predictions.jsonl").exists()  # a scored file is not copied as new predictions


def test_baseline_comparison(evals):
    root, _, client, runs, m = evals
    a_id = runs["a"].info.run_id
    same = m["b"]["comparison"]  # the same model again: no discordant pairs
    assert same["baseline_run"] == a_id and same["diff"] == 0 and same["only_a"] == same["only_b"] == 0
    assert same["mcnemar_p"] == 1.0
    assert json.loads((root / "b" / "metrics.json").read_text())["comparison"] == same
    oracle = m["d"]["comparison"]  # the gold SQL vs the policy: better by every question the policy missed
    assert m["d"]["ex"] == 1.0 and oracle["ex_b"] == m["a"]["ex"]
    assert oracle["only_a"] == 30 - m["a"]["n_correct"] and oracle["only_b"] == 0
    assert oracle["diff"] == pytest.approx(1 - m["a"]["ex"]) and oracle["mcnemar_p"] < 0.05
    for name, comp in (("b", same), ("d", oracle)):
        run = runs[name]
        assert run.data.tags["slmsql.baseline_run"] == a_id
        assert run.data.tags["slmsql.verdict"] == comp["verdict"]
        names = {"diff": "vs_baseline/diff", "mcnemar_p": "vs_baseline/p", "ex_b": "baseline/ex",
                 "diff_ci_low": "vs_baseline/diff_ci_low", "diff_ci_high": "vs_baseline/diff_ci_high",
                 "only_a": "vs_baseline/only_this_right", "only_b": "vs_baseline/only_baseline_right"}
        for key, name in names.items():
            assert run.data.metrics[name] == as_logged(comp[key]), key
        baseline_link = f"[a](#/experiments/{run.info.experiment_id}/runs/{a_id})"  # the baseline, a link to its run
        assert f"vs {baseline_link}: {100 * comp['ex_b']:.1f}% → {100 * comp['ex_a']:.1f}%" \
            in run.data.tags["mlflow.note.content"]
        assert f": {comp['verdict']} at α = 0.05. {comp['only_a']} questions only this run got right, " \
            f"{comp['only_b']} only the baseline." in run.data.tags["mlflow.note.content"]
    assert runs["d"].data.tags["slmsql.verdict"] != runs["b"].data.tags["slmsql.verdict"]
    assert "vs_baseline/diff" not in runs["a"].data.metrics
    # the discordant questions, listed: none for the same model twice; for the oracle, every one `a` missed
    wrong_in_a = {r["id"] for r in read(root / "a" / "results.jsonl") if not r["correct"]}
    for name, ids in (("b", set()), ("d", wrong_in_a)):
        path = client.download_artifacts(runs[name].info.run_id, "disagreements_table.json", str(root / name))
        table = json.loads(Path(path).read_text())
        assert {row[0] for row in table["data"]} == ids
        assert {row[table["columns"].index("right")] for row in table["data"]} <= {name}


@pytest.fixture
def no_generation(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("generation started before the baseline was checked")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(generation, "predict", refuse)


@pytest.mark.parametrize("over, message", [
    ({"dataset_name": "toy-dev"}, r"has slmsql.dataset='dev', this run 'toy-dev'"),
    ({"match": "spider"}, r"has slmsql.match='bird', this run 'spider'"),
])
def test_baseline_of_another_kind_is_refused(evals, policy, tmp_path, monkeypatch, no_generation, over, message):
    _, uri, _, runs, _ = evals
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = eval_cfg(policy, tmp_path / "out", model=str(policy.model), baseline_run=runs["a"].info.run_id, **over)
    with pytest.raises(SlmsqlError, match=message + ".*same dataset and match mode"):
        evaluate.main(cfg)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_baseline_that_is_not_an_evaluation_is_refused(evals, policy, tmp_path, monkeypatch, no_generation):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", policy.tracking_uri)  # the fixture's store: its sft run
    cfg = eval_cfg(policy, tmp_path / "out", model=str(policy.model), baseline_run=policy.sft_run_id)
    with pytest.raises(SlmsqlError, match=r"has stage 'sft', expected 'evaluate'"):
        evaluate.main(cfg)


def test_missing_baseline_run_is_refused(policy, tmp_path, no_generation):
    args = ["evaluate", "--data", str(policy.dev), "--db-root", str(policy.db_root), "--model", str(policy.model),
            "--output-dir", str(tmp_path / "out"), "--baseline-run", "0123456789abcdef0123456789abcdef"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "baseline run '0123456789abcdef0123456789abcdef' does not exist" in result.output
    assert not (tmp_path / "out").exists()


# ---- bad or odd input, no model needed -------------------------------------------------------------------

EXAMPLES = Path(__file__).parents[1] / "examples"


def test_prediction_utf8_cannot_encode_is_scored_and_written(tmp_path):
    """A lone surrogate (a JSON "\\ud800" escape) in a prediction: scored, written exactly, run exit 0."""
    from slmsql.inputs.data import read_jsonl

    preds = tmp_path / "preds.jsonl"
    preds.write_text('{"id": "q1", "sql": "SELECT \'\\ud800\'"}\n{"id": "q2", "sql": "SELECT 1"}\n')
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["evaluate", "--data", str(EXAMPLES / "gold.jsonl"), "--db-root",
                                      str(EXAMPLES / "databases"), "--predictions", str(preds), "--output-dir",
                                      str(out)])
    assert result.exit_code == 0, result.output
    rows = {r["id"]: r for r in read_jsonl(out / "results.jsonl")}
    assert len(rows) == 10 and rows["q3"]["status"] == "missing"
    q1 = rows["q1"]
    assert q1["predicted_sql"] == "SELECT '\ud800'"  # the same Python string that was read
    assert (q1["correct"], q1["status"]) == (False, "error") and "surrogates not allowed" in q1["error"]
    assert json.loads((out / "metrics.json").read_text())["n"] == 10
    (run,) = mlflow.search_runs(experiment_names=["slmsql"], output_format="list")
    table = json.loads(Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id,
                                                                artifact_path="results_table.json")).read_text())
    col = table["columns"].index("predicted_sql")
    assert [r[col] for r in table["data"] if r[0] == "q1"] == ["SELECT '\ufffd'"]  # display copy: replaced


def test_db_id_outside_db_root_is_refused(tmp_path):
    """`../../x` is a path, not a database name: refused at its line, even when that path holds a database."""
    import shutil

    root = tmp_path / "r1" / "r2" / "dbs"
    root.mkdir(parents=True)
    (tmp_path / "r1" / "x").mkdir()  # root/../../x/../../x.sqlite is tmp_path/x.sqlite
    shutil.copy(EXAMPLES / "databases" / "shop" / "shop.sqlite", tmp_path / "x.sqlite")
    (root / "shop").mkdir()
    shutil.copy(EXAMPLES / "databases" / "shop" / "shop.sqlite", root / "shop" / "shop.sqlite")
    data = tmp_path / "bad.jsonl"
    data.write_text('{"id": "a", "db_id": "shop", "question": "q", "sql": "SELECT 1"}\n'
                    '{"id": "b", "db_id": "../../x", "question": "q", "sql": "SELECT 1"}\n')
    preds = tmp_path / "preds.jsonl"
    preds.write_text('{"id": "a", "sql": "SELECT 1"}\n{"id": "b", "sql": "SELECT 1"}\n')
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["evaluate", "--data", str(data), "--db-root", str(root), "--predictions",
                                      str(preds), "--output-dir", str(out)])
    assert result.exit_code == 2, result.output
    assert f"{data}:2: field 'db_id': " in result.output and "'../../x'" in result.output
    assert not out.exists() and not out.with_name("out.partial").exists()


def test_model_that_does_not_load_fails_before_any_output_or_run(tmp_path):
    """A wrong --model path stops evaluate before its output folder or an MLflow run exists."""
    args = ["evaluate", "--data", str(EXAMPLES / "gold.jsonl"), "--db-root", str(EXAMPLES / "databases"),
            "--model", str(tmp_path / "no-such-model"), "--output-dir", str(tmp_path / "out")]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0 and "no-such-model" in result.output, result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    assert mlflow.search_runs(search_all_experiments=True, output_format="list") == []
