"""The GRPO stage: bad input refused before any model loads, a run tracked on a real `mlflow server`, resume."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pytest
from policy import foreign_adapter, policy_fixture, read, tracking_store, write  # noqa: F401  (the fixture)
import watched

from slmsql import configs
from slmsql.policy import models
from slmsql.rewards import registry as rewards
from slmsql.tracking import runs as tracking
from slmsql.training import hf_trainer as training
from slmsql.stages import grpo
from slmsql.errors import SlmsqlError


def grpo_cfg(policy, data, out, **over):
    return configs.load(configs.GRPOStageConfig, None, {
        "data": str(data), "db_root": str(policy.db_root), "model": str(policy.model), "output_dir": str(out),
        "num_generations": 4, "per_device_train_batch_size": 8, "max_completion_length": 32, "max_steps": 4,
        "save_steps": 2, "completions_every": 2, "workers": 1, "timeout_s": 2.0, "lora_r": 8, "lora_alpha": 16,
        **over})


def band_file(policy, path, n=8):
    """Questions the policy answers right some of the time, shaped like a filter band file."""
    return write(path, [{**r, "pass_rate": 0.5, "k": 4, "n_correct": 2} for r in read(policy.train)[:n]])


# ---- bad input: refused before any model loads ----------------------------------------------------------

@pytest.fixture
def paths(shop, tmp_path):
    """What these checks read of the policy, without training it (each test names it `policy`): 8 gold questions on the
    `shop` database, and a model path that is never loaded."""
    train = write(tmp_path / "train.jsonl", [{"id": f"q{i}", "db_id": "shop", "question": f"Items above {i}?",
                                              "sql": f"SELECT name FROM item WHERE price > {i}"} for i in range(8)])
    return SimpleNamespace(train=train, db_root=shop, model=tmp_path / "policy")


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_model", refuse)


def _refused(cfg, match):
    with pytest.raises(SlmsqlError, match=match):
        grpo.main(cfg)
    out = Path(cfg.output_dir)
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()
    assert [e.name for e in mlflow.MlflowClient().search_experiments()] in ([], ["Default"])  # no run started


def test_unknown_reward(paths, tmp_path, no_model_load):
    policy = paths
    cfg = grpo_cfg(policy, band_file(policy, tmp_path / "band.jsonl"), tmp_path / "out", rewards="execution,vibes")
    _refused(cfg, r"unknown reward\(s\) \['vibes'\]; registered: " + re.escape(str(sorted(rewards.REGISTRY))))


def test_reward_weights_must_match_rewards(paths, tmp_path, no_model_load):
    policy = paths
    cfg = grpo_cfg(policy, band_file(policy, tmp_path / "band.jsonl"), tmp_path / "out", reward_weights="1,0.5,2")
    _refused(cfg, r"3 reward weights for 2 rewards")


def test_num_generations_must_divide_batch(paths, tmp_path, no_model_load):
    policy = paths
    cfg = grpo_cfg(policy, band_file(policy, tmp_path / "band.jsonl"), tmp_path / "out", num_generations=3)
    _refused(cfg, r"num_generations \(3\) must divide per_device_train_batch_size \(8\)")


def test_base_adapter_for_another_base(paths, tmp_path, no_model_load):
    policy = paths
    cfg = grpo_cfg(policy, band_file(policy, tmp_path / "band.jsonl"), tmp_path / "out",
                   base_adapter=str(foreign_adapter(tmp_path)))
    _refused(cfg, r"was trained on base model .*other-base.*, not on .*policy")


def test_missing_database(paths, tmp_path, no_model_load):
    policy = paths
    rows = read(band_file(policy, tmp_path / "band.jsonl"))
    data = write(tmp_path / "band.jsonl", rows + [{**rows[0], "id": "x", "db_id": "atlantis"}])
    _refused(grpo_cfg(policy, data, tmp_path / "out"), r"band.jsonl: no database for db_id \['atlantis'\]")


def test_band_without_pass_rate_warns_and_goes_on(paths, tmp_path, monkeypatch, caplog):
    policy = paths
    data = write(tmp_path / "gold.jsonl", read(policy.train)[:8])

    class Loaded(Exception):
        pass

    def loaded(*a, **k):
        raise Loaded  # stop at the first model load: everything before it accepted the file

    monkeypatch.setattr(models, "load_model", loaded)
    monkeypatch.setattr(models, "load_tokenizer", loaded)  # the prompts' token count reads the tokenizer first
    with caplog.at_level(logging.WARNING, logger="slmsql.stages.grpo"), pytest.raises(Loaded):
        grpo.main(grpo_cfg(policy, data, tmp_path / "out"))
    assert any("gold.jsonl has no pass_rate column" in r.getMessage() for r in caplog.records)


def test_metric_names_are_made_safe():
    # TRL's profiling keys (logged when it profiles) carry spaces and colons
    assert tracking.metric_name("profiling/Time taken: GRPOTrainer.transformers.generate") == \
        "profiling/Time_taken_GRPOTrainer.transformers.generate"
    assert tracking.metric_name("rewards/execution/mean") == "rewards/execution/mean"


# ---- a run tracked on a real MLflow server --------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    with open(root / "server.log", "wb") as log:
        proc, uri = tracking.start_server(port=0, store=root / "store.db", artifacts=root / "artifacts",
                                          log_file=log, timeout_s=watched.STALL_S)
    yield uri
    proc.terminate()
    proc.wait(timeout=watched.STALL_S)


@pytest.fixture(scope="module")
def served_run(policy, server, tmp_path_factory):
    """`slmsql grpo` for 4 steps on plain gold questions (no pass_rate), tracked on the server."""
    root = tmp_path_factory.mktemp("grpo")
    data = write(root / "gold.jsonl", read(policy.train)[:8])
    cfg = grpo_cfg(policy, data, root / "out", experiment="grpo-served")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(logging.WARNING)
    logging.getLogger("slmsql.stages.grpo").addHandler(handler)
    try:
        with tracking_store(server):  # sampled every 10 s: a shorter run gets its one sample at its end
            summary = grpo.main(cfg)
    finally:
        logging.getLogger("slmsql.stages.grpo").removeHandler(handler)
    client = mlflow.MlflowClient(server)
    (run,) = client.search_runs([client.get_experiment_by_name("grpo-served").experiment_id])
    return cfg, summary, client, run, records


def test_served_run_trl_metrics(served_run):
    cfg, summary, client, run, records = served_run
    assert run.info.status == "FINISHED" and run.data.tags["slmsql.stage"] == "grpo"
    assert any("no pass_rate column" in r.getMessage() for r in records)  # trained anyway, with a warning
    m = run.data.metrics
    for key in ("reward", "reward_std", "frac_reward_zero_std", "grad_norm", "loss", "learning_rate",
                "rewards/execution/mean", "rewards/format/mean", "completions/mean_length", "entropy"):
        assert key in m, key
    assert 0.0 <= m["rewards/format/mean"] <= 0.2 + 1e-6 and 0.0 <= m["frac_reward_zero_std"] <= 1.0
    assert all(re.fullmatch(r"[\w./-]+", k) for k in m), [k for k in m if not re.fullmatch(r"[\w./-]+", k)]
    history = client.get_metric_history(run.info.run_id, "reward")
    assert sorted(h.step for h in history) == [1, 2, 3, 4]


def test_served_run_exec_telemetry_and_summary(served_run):
    cfg, summary, client, run, _ = served_run
    m = run.data.metrics
    statuses = [f"exec/{s}" for s in ("correct", "wrong_result", "error", "timeout", "truncated", "rejected",
                                      "no_sql")]
    for key in statuses + ["exec/frac_groups_correctness_varies"]:
        assert key in m and 0.0 <= m[key] <= 1.0, key
    for step in (1, 2, 3, 4):  # each step's mix of statuses covers every completion
        total = sum(next(h.value for h in client.get_metric_history(run.info.run_id, k) if h.step == step)
                    for k in statuses)
        assert total == pytest.approx(1.0)
    for key in ("reward", "reward_std", "frac_reward_zero_std", "grad_norm", "exec/frac_groups_correctness_varies",
                "exec/correct"):
        mean = sum(h.value for h in client.get_metric_history(run.info.run_id, key)) / 4  # over the 4 steps
        assert m[f"summary/{key}"] == pytest.approx(summary[f"summary/{key}"]) == pytest.approx(mean, rel=1e-5)
    assert m["steps"] == summary["steps"] == 4
    assert "system/cpu_utilization_percentage" in m  # MLflow's system metrics, however short the run


def test_served_run_description_says_whether_there_was_signal(served_run):
    _, summary, _, run, _ = served_run
    note = run.data.tags["mlflow.note.content"]
    varies = summary["summary/exec/frac_groups_correctness_varies"]
    assert note.startswith("GRPO, 4 steps in ")
    assert (f"Correctness signal in {varies:.0%} of prompt groups" if varies else "No correctness signal") in note
    assert f"{summary['summary/frac_reward_zero_std']:.0%} of groups had zero reward variance" in note
    assert f"{summary['summary/exec/correct']:.0%} of sampled completions correct" in note


def test_served_run_training_curves_and_clean_adapter(served_run):
    _, _, client, run, _ = served_run
    assert "training_curves.png" in {f.path for f in client.list_artifacts(run.info.run_id)}
    # PEFT's boilerplate README ("More Information Needed") is not logged as if it were the card
    assert "adapter/README.md" not in {f.path for f in client.list_artifacts(run.info.run_id, "adapter")}
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.name == "rl" and [t.value for t in inp.tags if t.key == "mlflow.data.context"] == ["training"]


def test_served_run_params_are_the_stage_config(served_run):
    cfg, _, _, run, _ = served_run
    params = run.data.params
    # the stage config and the prompt settings' hashes (promptcheck), not TRL's ~224 training arguments
    assert set(params) == set(configs.to_params(cfg)) | {"prompt.system_prompt", "prompt.chat_template",
                                                         "prompt.schema_source"}
    assert "" not in params.values() and "adapter_mode" not in params  # no base adapter: the mode does not apply
    assert "adam_beta1" not in params and "vocab_size" not in params
    assert params["num_generations"] == "4" and params["rewards"] == "execution,format"


def test_served_run_completions_tables(served_run):
    from slmsql.sql.extract import extract_sql

    cfg, _, client, run, _ = served_run
    tables = sorted(f.path for f in client.list_artifacts(run.info.run_id, "completions"))
    assert tables == ["completions/step_00002.json", "completions/step_00004.json"]  # every 2 steps
    table = json.loads(Path(client.download_artifacts(run.info.run_id, tables[0])).read_text())
    assert table["columns"] == ["step", "id", "question", "sql", "completion", "gold_sql", "status", "execution",
                                "format", "advantage"]
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert len(rows) == 8 and all(isinstance(r["completion"], str) for r in rows)
    gold = {r["id"]: r for r in read(cfg.data)}
    for r in rows:  # each completion beside the question it answers and the gold SQL
        assert (r["question"], r["gold_sql"]) == (gold[r["id"]]["question"], gold[r["id"]]["sql"])
        assert r["sql"] == extract_sql(r["completion"])[0]
    assert {r["format"] for r in rows} <= {0.0, 0.2}  # rounded: no float32 noise (0.200000003)
    assert {r["execution"] for r in rows} <= {0.0, 0.1, 1.0}
    # statuses named as the exec/<outcome> metrics name them, and paid as the reward tiers say
    tier = {"correct": 1.0, "wrong_result": 0.1}
    assert all(r["execution"] == tier.get(r["status"], 0.0) for r in rows)
    assert {r["status"] for r in rows} <= {"correct", "wrong_result", "error", "timeout", "truncated", "rejected",
                                           "no_sql"}


def test_served_run_adapter_reloads_and_generates(served_run, policy, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slmsql.inputs.data import read_gold
    from slmsql.inputs.prompts import builder_for, render_prompt
    from slmsql.generation.sampling import generate

    cfg, _, client, run, _ = served_run
    names = {f.path for f in client.list_artifacts(run.info.run_id, "adapter")}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "adapter/tokenizer.json",
            "adapter/slmsql_grpo_config.json"} <= names
    assert "summary.json" in {f.path for f in client.list_artifacts(run.info.run_id)}
    local = client.download_artifacts(run.info.run_id, "adapter", str(tmp_path))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(policy.model), local)
    tokenizer = AutoTokenizer.from_pretrained(local)
    ex = read_gold(policy.train)[0]
    prompt = render_prompt(tokenizer, builder_for(cfg).messages(ex))
    (texts,) = generate(model, tokenizer, [prompt], max_new_tokens=24, progress=False)
    assert texts[0].strip()
    # the finished output folder is the same adapter, and the .partial folder is gone
    out = Path(cfg.output_dir)
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (Path(local) / "adapter_model.safetensors").read_bytes()
    assert not out.with_name("out.partial").exists()


# ---- resume after a crash -------------------------------------------------------------------------------

class Crash(Exception):
    pass


def test_resume_continues_the_same_run(policy, tmp_path, monkeypatch):
    """A crash right after checkpoint-2 is saved; `--resume` trains steps 3-4 in the same MLflow run."""
    cfg = grpo_cfg(policy, band_file(policy, tmp_path / "band.jsonl"), tmp_path / "out")
    original = training.metrics_callback

    def crashing(*args):
        base = original(*args)

        class CrashAfterCheckpoint(type(base)):
            def on_save(self, args, state, control, **kwargs):
                if state.global_step == 2:
                    raise Crash("simulated crash after checkpoint-2")

        return CrashAfterCheckpoint()

    with monkeypatch.context() as m:
        m.setattr(training, "metrics_callback", crashing)
        with pytest.raises(Crash):
            grpo.main(cfg)
    partial = tmp_path / "out.partial"
    assert (partial / "checkpoint-2").is_dir() and (partial / "resume_state.json").exists()
    client = mlflow.MlflowClient()
    (crashed,) = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])
    assert crashed.info.status == "FAILED"

    # without --resume the unfinished folder is not silently thrown away
    with pytest.raises(SlmsqlError, match="pass --resume"):
        grpo.main(cfg)

    summary = grpo.main(dataclasses.replace(cfg, resume=True))
    (run,) = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])
    assert run.info.run_id == crashed.info.run_id and run.info.status == "FINISHED"
    assert summary["steps"] == 4 and summary["resumed_at_step"] == 2  # its train_seconds: steps 3-4 only
    assert run.data.metrics["resumed_at_step"] == 2 and "4 steps in " in run.data.tags[tracking.NOTE]
    assert "for steps 3-4 (resumed from its step-2 checkpoint" in run.data.tags[tracking.NOTE]
    # steps 1-2 were logged before the crash, 3-4 after: none twice, so training went on from checkpoint-2
    for key in ("loss", "reward", "exec/correct"):
        assert [h.step for h in sorted(client.get_metric_history(run.info.run_id, key), key=lambda h: h.step)] \
            == [1, 2, 3, 4], key
    state = json.loads((tmp_path / "out" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    assert [h["step"] for h in state["log_history"] if "reward" in h] == [1, 2, 3, 4]
    assert not partial.exists() and (tmp_path / "out" / "adapter" / "adapter_model.safetensors").exists()
    # each completions table shipped once: step 2's before or after the crash, never both (log_table appends)
    tables = sorted(f.path for f in client.list_artifacts(run.info.run_id, "completions"))
    assert tables == ["completions/step_00002.json", "completions/step_00004.json"]
    for t in tables:
        assert len(json.loads(Path(client.download_artifacts(run.info.run_id, t)).read_text())["data"]) == 8


# ---- training length in passes over the band (max_steps -1, TRL's rule) ---------------------------------

def test_epochs_draw_every_question_once_a_pass(policy, tmp_path):
    """`--max-steps -1 --num-train-epochs 2` on 6 questions at 2 prompts a step: 6 steps; steps 1-3 (the first
    pass) draw each of the 6 questions exactly once, and so do steps 4-6 (a study's "every band question drawn N
    times, once a pass" rests on it), not merely twice in all."""
    cfg = grpo_cfg(policy, band_file(policy, tmp_path / "band.jsonl", n=6), tmp_path / "out", max_steps=-1,
                   num_train_epochs=2, completions_every=1, save_steps=100)
    summary = grpo.main(cfg)
    assert summary["steps"] == 6
    client = mlflow.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])
    by_step: dict[int, list[str]] = {}
    for f in client.list_artifacts(run.info.run_id, "completions"):
        table = json.loads(Path(client.download_artifacts(run.info.run_id, f.path)).read_text())
        ids = [row[table["columns"].index("id")] for row in table["data"]]
        assert len(ids) == 8 and len(set(ids)) == 2  # 2 prompts x G = 4
        by_step[int(f.path.rsplit("_", 1)[1].removesuffix(".json"))] = sorted(set(ids))
    assert sorted(by_step) == [1, 2, 3, 4, 5, 6]
    every = sorted(r["id"] for r in read(cfg.data))
    for passed, steps in enumerate(([1, 2, 3], [4, 5, 6]), 1):
        drawn = [q for s in steps for q in by_step[s]]
        assert sorted(drawn) == every, f"pass {passed} (steps {steps}) drew {sorted(drawn)}"


@pytest.mark.parametrize("over, field", [({"max_steps": 0}, "max_steps"), ({"max_steps": -2}, "max_steps"),
                                         ({"max_steps": -1, "num_train_epochs": 0}, "num_train_epochs")])
def test_training_length_must_be_some_steps_or_passes(paths, tmp_path, over, field):
    with pytest.raises(SlmsqlError, match=field):
        grpo_cfg(paths, paths.train, tmp_path / "out", **over)
