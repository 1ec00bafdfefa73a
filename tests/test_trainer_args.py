"""`--trainer-args` by the one rule of `training.trl_config`: stage settings < stage-config fields < trainer args;
a trainer arg naming an slmsql option, a field slmsql owns, or no TRL field is refused before any model loads.

One optimizer step per stage shows the fields reach the trainer (the `args` it was built with, and what they do).
"""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
from click.testing import CliRunner
from policy import policy_fixture, read, tracking_store, write  # noqa: F401  (the fixture)

from slmsql import configs
from slmsql.policy import models
from slmsql.training import hf_trainer as training
from slmsql.cli import main as cli
from slmsql.stages import grpo, sft


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer-args")
    return root, f"sqlite:///{root}/mlflow.db"


def built_with(stage_main, cfg, uri):
    """Run a stage; return the TrainingArguments its trainer was built with (as the trainer's callbacks see them)."""
    seen = []
    original = training.metrics_callback

    def recording(outbox):
        class Recording(type(original(outbox))):
            def on_train_begin(self, args, state, control, **kwargs):
                seen.append(args)

        return Recording()

    with tracking_store(uri), pytest.MonkeyPatch.context() as m:
        m.setattr(training, "metrics_callback", recording)
        stage_main(cfg)
    (args,) = seen
    return args


def test_sft_trainer_args_reach_the_trainer(policy, store):
    root, uri = store
    cfg = configs.load(configs.SFTStageConfig, None, {
        "data": str(policy.train), "db_root": str(policy.db_root), "model": str(policy.tiny),
        "output_dir": str(root / "sft"), "max_steps": 1, "per_device_train_batch_size": 4, "learning_rate": 2e-3,
        # the stage sets gradient_checkpointing=False, a cosine schedule and warmup_steps: the command line wins
        "trainer_args": "gradient_checkpointing=true lr_scheduler_type=constant warmup_steps=0.25 max_grad_norm=0.5"})
    args = built_with(sft.main, cfg, uri)
    assert args.gradient_checkpointing is True
    assert args.lr_scheduler_type == "constant" and args.warmup_steps == 0.25 and args.max_grad_norm == 0.5
    assert args.learning_rate == 2e-3 and args.max_steps == 1  # stage-config fields TRL knows
    assert args.save_strategy == "no" and args.report_to == []  # stage settings left alone; slmsql's own


def test_grpo_trainer_args_reach_the_trainer(policy, store):
    root, uri = store
    data = write(root / "band.jsonl", [{**r, "pass_rate": 0.5} for r in read(policy.train)[:4]])
    cfg = configs.load(configs.GRPOStageConfig, None, {
        "data": str(data), "db_root": str(policy.db_root), "model": str(policy.model),
        "output_dir": str(root / "grpo"), "num_generations": 4, "per_device_train_batch_size": 4,
        "max_completion_length": 16, "max_steps": 1, "save_steps": 1, "completions_every": 1, "workers": 1,
        "timeout_s": 2.0, "lora_r": 4, "lora_alpha": 8, "run_name": "grpo-args",
        # the stage sets save_strategy=steps, log_completions=True, gradient_checkpointing=False
        "trainer_args": "save_strategy=no log_completions=false gradient_checkpointing=true loss_type=grpo"})
    args = built_with(grpo.main, cfg, uri)
    assert args.save_strategy == "no" and args.log_completions is False and args.gradient_checkpointing is True
    assert args.loss_type == "grpo" and args.num_generations == 4 and args.save_steps == 1
    # and they did what they say: no checkpoint although save_steps=1, no completions table although every=1
    out = Path(cfg.output_dir)
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert not list(out.glob("checkpoint-*")) and not (out / "completions").exists()
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id],
                                "attributes.run_name = 'grpo-args'")
    assert run.data.params["trainer_args.log_completions"] == "false"
    assert not client.list_artifacts(run.info.run_id, "completions")


@pytest.mark.parametrize("stage", ["sft", "grpo"])
@pytest.mark.parametrize("arg, message", [
    ("output_dir=elsewhere", "trainer_args: output_dir is set by slmsql (the stage's staging folder)"),
    ("report_to=mlflow", "trainer_args: report_to is set by slmsql"),
    ("learning_rate=0.1", "trainer_args: learning_rate is an slmsql option; set it with --learning-rate"),
    ("max_steps=3", "trainer_args: max_steps is an slmsql option; set it with --max-steps"),
    ("warmup_ratio=0.1", "Config has no field 'warmup_ratio'"),  # gone in transformers 5: warmup_steps=0.1
    ("save_strategy=sometimes", "Config: sometimes is not a valid SaveStrategy"),  # TRL's own check
])
def test_refused_before_any_model_loads(stage, arg, message, policy, tmp_path, monkeypatch):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    data = write(tmp_path / "data.jsonl", read(policy.train)[:4])
    result = CliRunner().invoke(cli, [stage, "--data", str(data), "--db-root", str(policy.db_root), "--model",
                                      str(policy.model), "--output-dir", str(tmp_path / "out"),
                                      "--trainer-args", arg])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    client = mlflow.MlflowClient()  # no run started either: the test's store as conftest made it
    assert [e.name for e in client.search_experiments()] == ["Default"] and not client.search_runs(["0"])


def test_command_line_values_are_not_yaml():
    # YAML would read `no` as False (then TRL: "False is not a valid SaveStrategy") and `1e-3` as a string
    assert configs.parse_trainer_args("save_strategy=no log_completions=false warmup_steps=1e-3 top_k=0 x=null") \
        == {"save_strategy": "no", "log_completions": False, "warmup_steps": 0.001, "top_k": 0, "x": None}
