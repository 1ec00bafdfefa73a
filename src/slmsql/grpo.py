"""GRPO: TRL GRPOTrainer with the execution reward, LoRA, and telemetry that proves the mechanism.

args -> data -> model -> rewards -> trainer -> save. Everything is checked before a model loads.
MLflow gets TRL's metrics (names made safe), the reward's execution-status mix and correctness-varying
group fraction, sampled completions as tables every `completions_every` steps, a run summary, and the final
adapter with its tokenizer and resolved config. `--resume` continues the crashed run in the same MLflow run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path

from .configs import GRPOStageConfig, parse_trainer_args
from .data import db_path, read_gold, write_json
from .errors import SlmsqlError
from .outputs import check_free, partial_dir, promote

log = logging.getLogger(__name__)
SUMMARY_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "grad_norm", "exec/correct",
                "exec/frac_groups_correctness_varies", "completions/mean_length", "entropy", "step_time")


def check_args(cfg: GRPOStageConfig, examples) -> tuple[list[float] | None, dict]:
    from .rewards import REGISTRY

    names = [n.strip() for n in cfg.rewards.split(",") if n.strip()]
    unknown = [n for n in names if n not in REGISTRY]
    if unknown or not names:
        raise SlmsqlError(f"unknown reward(s) {unknown or cfg.rewards!r}; registered: {sorted(REGISTRY)}")
    weights = [float(w) for w in cfg.reward_weights.split(",")] if cfg.reward_weights else None
    if weights and len(weights) != len(names):
        raise SlmsqlError(f"{len(weights)} reward weights for {len(names)} rewards ({names})")
    if cfg.per_device_train_batch_size % cfg.num_generations:
        raise SlmsqlError(f"num_generations ({cfg.num_generations}) must divide per_device_train_batch_size "
                          f"({cfg.per_device_train_batch_size}): each batch holds whole groups")
    if "pass_rate" not in examples[0].extra:
        log.warning("%s has no pass_rate column: training on it as plain data, not a filtered band", cfg.data)
    return weights, parse_trainer_args(cfg.trainer_args)


def completions_logger(output_dir: Path, every: int):
    """Ship TRL's per-step completions parquet to MLflow as a table every `every` steps.

    TRL writes `completions/completions_<step>.parquet` only after the callbacks' on_log for that step, so
    each on_log ships the files that exist by then (the last one at the end-of-training log). A `.logged`
    marker keeps a resumed run from shipping a file twice: log_table appends to an existing artifact."""
    from transformers import TrainerCallback

    class CompletionsToMlflow(TrainerCallback):
        def _ship(self, state):
            import mlflow
            import pandas as pd

            if not state.is_world_process_zero:
                return
            for path in sorted((output_dir / "completions").glob("completions_*.parquet")):
                step, marker = int(path.stem.rsplit("_", 1)[1]), path.with_suffix(".logged")
                if step % every or marker.exists():
                    continue
                df = pd.read_parquet(path)
                as_text = lambda v: v if isinstance(v, str) else json.dumps(  # noqa: E731
                    v.tolist() if hasattr(v, "tolist") else v, default=str)  # chat turns arrive as arrays
                df = df.assign(**{c: df[c].map(as_text) for c in ("prompt", "completion") if c in df})
                mlflow.log_table(df, f"completions/step_{step:05d}.json")
                marker.touch()

        def on_log(self, args, state, control, **kwargs):
            self._ship(state)

        def on_train_end(self, args, state, control, **kwargs):
            self._ship(state)

    return CompletionsToMlflow()


def summary_metrics(log_history: list[dict]) -> dict:
    """Means over the run of the signals that separate 'no gradient signal' from 'signal, no gain'."""
    out = {}
    for key in SUMMARY_KEYS:
        vals = [h[key] for h in log_history if isinstance(h.get(key), (int, float))]
        if vals:
            out[f"summary/{key.replace('/', '_')}"] = sum(vals) / len(vals)
    return out


def main(cfg: GRPOStageConfig) -> dict:
    import mlflow
    import pandas as pd
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from . import rewards, tracking
    from .models import check_adapter_base, load_model
    from .prompts import builder_for
    from .sandbox import Limits, SandboxPool
    from .sft import device_args, lora_config

    # args: data, rewards, batch shape and adapter are all checked before any model loads
    examples = read_gold(cfg.data)
    missing = sorted({e.db_id for e in examples if not db_path(cfg.db_root, e.db_id).is_file()})
    if missing:
        raise SlmsqlError(f"{cfg.data}: no database for db_id {missing[:5]} under {cfg.db_root}")
    weights, extra = check_args(cfg, examples)
    if cfg.base_adapter:
        check_adapter_base(cfg.base_adapter, cfg.model)
    out = check_free(cfg.output_dir, cfg.overwrite or cfg.resume)
    work = partial_dir(out)
    if work.exists() and not cfg.resume:
        if not cfg.overwrite:
            raise SlmsqlError(f"{work} holds an unfinished run: pass --resume to continue it, or --overwrite")
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    identity = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("resume", "overwrite", "run_name")}
    run_id = tracking.resume_state(work, identity) if cfg.resume else None
    tags = {"slmsql.model": cfg.model, "slmsql.base_adapter": cfg.base_adapter,
            "slmsql.adapter_mode": cfg.adapter_mode if cfg.base_adapter else "none"}

    with tracking.stage_run("grpo", cfg, tags=tags, run_id=run_id) as run, \
            SandboxPool(cfg.workers or None, Limits(timeout_s=cfg.timeout_s)) as pool:
        tracking.save_resume_state(work, identity, run.info.run_id)
        # data: conversational prompts; `sql`, `db_path`, `id` reach the reward functions as columns
        builder = builder_for(cfg)
        rows = [{"prompt": builder.messages(e), "sql": e.sql, "id": e.id,
                 "db_path": str(db_path(cfg.db_root, e.db_id))} for e in examples]
        mlflow.log_input(mlflow.data.from_pandas(pd.DataFrame([e.to_json() for e in examples]),
                                                 source=cfg.data, name="rl"), context="training")

        # model: continue the SFT adapter, or merge it and stack a new one, or a fresh LoRA / full model
        continue_adapter = bool(cfg.base_adapter) and cfg.adapter_mode == "continue"
        if cfg.base_adapter and not continue_adapter:
            model, tokenizer = load_model(cfg.model, cfg.base_adapter, merge_adapter=True)
            model.requires_grad_(True)
        else:
            model, tokenizer = load_model(cfg.model, cfg.base_adapter or None, trainable=True)
        peft_config = lora_config(cfg) if cfg.use_lora and not continue_adapter else None

        # rewards: registry functions bound to this run's sandbox and tiers
        tiers = rewards.Tiers(runs=cfg.runs_tier, format=cfg.format_tier)
        reward_funcs = rewards.build([n.strip() for n in cfg.rewards.split(",")], executor=pool, tiers=tiers,
                                     match=cfg.match)

        # trainer
        args = GRPOConfig(
            output_dir=str(work), max_steps=cfg.max_steps, learning_rate=cfg.learning_rate,
            lr_scheduler_type=cfg.lr_scheduler_type, per_device_train_batch_size=cfg.per_device_train_batch_size,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps, num_generations=cfg.num_generations,
            beta=cfg.beta, epsilon=cfg.epsilon, temperature=cfg.temperature,
            max_completion_length=cfg.max_completion_length, reward_weights=weights, seed=cfg.seed,
            logging_steps=cfg.logging_steps, save_steps=cfg.save_steps, save_strategy="steps",
            report_to="none", log_completions=True, num_completions_to_print=0,
            **{"gradient_checkpointing": False, **device_args(), **extra})
        trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=args,
                              train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                              peft_config=peft_config,
                              callbacks=[tracking.trainer_callback(), completions_logger(work, cfg.completions_every)])
        tracking.quiet_progress(trainer)
        t0 = time.time()
        trainer.train(resume_from_checkpoint=_last_checkpoint(work) if cfg.resume else None)

        # save: the adapter (PEFT format) + tokenizer + resolved config, logged to the run
        final = work / "adapter"
        trainer.model.save_pretrained(final)
        tokenizer.save_pretrained(final)
        write_json(final / "slmsql_grpo_config.json", dataclasses.asdict(cfg))
        summary = {**summary_metrics(trainer.state.log_history), "train_seconds": time.time() - t0,
                   "steps": trainer.state.global_step}
        mlflow.log_metrics(summary)
        mlflow.log_artifacts(str(final), "adapter")
        write_json(work / "summary.json", summary)
        mlflow.log_artifact(str(work / "summary.json"))
    (work / "resume_state.json").unlink()
    promote(work, out)
    log.info("GRPO done: %s", json.dumps(summary))
    return summary


def _last_checkpoint(work: Path):
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(str(work))

