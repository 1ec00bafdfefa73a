"""Gradient checkpointing on (as the real-model recipes run): SFT and GRPO still learn (`learning.assert_learned`)
with a fresh LoRA, with `--base-adapter` trained further (continue: TRL gets a PeftModel and peft_config=None)
and, for GRPO, stacked on the merged SFT adapter. The pitfall: checkpointed blocks whose inputs need no grad
(frozen embeddings under a LoRA) can leave the LoRA without gradients, so the run "trains" and nothing moves.
Each run is 2 steps on the fixture policy, and checks that checkpointing was really on in its trainer.
"""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
import scripted
from learning import assert_learned, prompt_for
from policy import policy_fixture, read, tracking_store  # noqa: F401  (the fixture)
from test_grpo_learns import grpo_cfg

from slmsql import configs
from slmsql.stages import grpo, sft


GC = {"trainer_args": "gradient_checkpointing=true"}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("real-path")
    return root, f"sqlite:///{root}/mlflow.db"


def run(store, stage, trainer_name, cfg):
    """Run a stage in the module's store; return (run id, the trainer it built)."""
    import trl

    seen = []
    base = getattr(trl, trainer_name)

    class Recorded(base):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen.append(self)

    with tracking_store(store[1]), pytest.MonkeyPatch.context() as m:
        m.setattr(trl, trainer_name, Recorded)
        if stage is grpo:  # learning needs rewards that vary within a group: scripted (one right, three wrong),
            # as test_grpo_learns does, not hoped for from a tiny policy's sampler on this machine's floats
            find = scripted.question_of(read(cfg.data))
            scripted.install(m, cfg.model, lambda p, i: scripted.right(find(p)) if i == 0 else scripted.WRONG,
                             group=cfg.num_generations)
        stage.main(cfg)
    client = mlflow.MlflowClient(store[1])
    (found,) = client.search_runs([client.get_experiment_by_name(cfg.experiment).experiment_id],
                                  f"attributes.run_name = '{cfg.run_name}'")
    return found.info.run_id, seen[-1]


def sft_cfg(policy, out: Path, **over):
    # the adapter is saved in output_dir itself: put it at <out>/adapter, where assert_learned looks
    return configs.load(configs.SFTStageConfig, None, {
        "data": str(policy.train), "db_root": str(policy.db_root), "model": str(policy.model),
        "output_dir": str(out / "adapter"), "run_name": out.name, "use_lora": True, "lora_r": 4, "lora_alpha": 8,
        "max_steps": 2, "per_device_train_batch_size": 8, "learning_rate": 1e-2, **over})


def checkpointed(trainer) -> bool:
    return bool(trainer.args.gradient_checkpointing and trainer.model.is_gradient_checkpointing)


@pytest.fixture(scope="module")
def sft_start(policy, store):
    """A plain SFT LoRA (no checkpointing) for the continued and stacked runs to start from."""
    out = store[0] / "sft-start"
    run(store, sft, "SFTTrainer", sft_cfg(policy, out))
    return out / "adapter"


def test_sft_fresh_lora_learns_with_checkpointing(policy, store):
    cfg = sft_cfg(policy, store[0] / "sft-gc", **GC)
    run_id, trainer = run(store, sft, "SFTTrainer", cfg)
    assert checkpointed(trainer)
    assert_learned(store[0] / "sft-gc", run_id, cfg.model, prompt_for(cfg), client=mlflow.MlflowClient(store[1]))


def test_sft_continued_adapter_learns_with_checkpointing(policy, store, sft_start):
    cfg = sft_cfg(policy, store[0] / "sft-gc-continue", base_adapter=str(sft_start), **GC)
    run_id, trainer = run(store, sft, "SFTTrainer", cfg)
    assert checkpointed(trainer)
    assert_learned(store[0] / "sft-gc-continue", run_id, cfg.model, prompt_for(cfg), start=sft_start,
                   continued=True, client=mlflow.MlflowClient(store[1]))


@pytest.mark.parametrize("mode", ["fresh", "continue", "stack"])
def test_grpo_learns_with_checkpointing(policy, store, sft_start, mode):
    over = {} if mode == "fresh" else {"base_adapter": str(sft_start), "adapter_mode": mode}
    cfg = grpo_cfg(policy, store[0] / f"grpo-gc-{mode}", **over, **GC)
    run_id, trainer = run(store, grpo, "GRPOTrainer", cfg)
    assert checkpointed(trainer)
    assert_learned(cfg.output_dir, run_id, cfg.model, prompt_for(cfg), start=None if mode == "fresh" else sft_start,
                   continued=mode == "continue", client=mlflow.MlflowClient(store[1]))


@pytest.mark.parametrize("stage", ["sft", "grpo"])
def test_trainer_args_turn_checkpointing_on_over_the_stage_default(tmp_path, stage):
    """Both training stages set gradient_checkpointing=False themselves; a recipe's or the command line's
    trainer_args must win (the rule in training.trl_config), or the real-model recipes would train without it."""
    from trl import GRPOConfig, SFTConfig

    from slmsql.training import hf_trainer as training

    cls, trl_cls = {"sft": (configs.SFTStageConfig, SFTConfig), "grpo": (configs.GRPOStageConfig, GRPOConfig)}[stage]
    on = configs.load(cls, None, GC, require=False)
    assert training.trl_config(trl_cls, on, tmp_path, gradient_checkpointing=False).gradient_checkpointing is True
    off = configs.load(cls, None, {}, require=False)
    assert training.trl_config(trl_cls, off, tmp_path, gradient_checkpointing=False).gradient_checkpointing is False
