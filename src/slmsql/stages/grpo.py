"""GRPO: TRL GRPOTrainer with the execution reward, LoRA, and telemetry that proves the mechanism.

args -> data -> model -> rewards -> trainer -> save. Everything is checked before a model loads.
MLflow gets TRL's metrics (names made safe), the reward's execution-status mix and correctness-varying
group fraction, sampled completions as tables every `completions_every` steps, a run summary, and the final
adapter with its tokenizer and resolved config. `--resume` continues the crashed run in the same MLflow run.
Under torchrun / `accelerate launch` every process generates and trains on its share of each batch, with
its own sandbox pool; the main process alone logs to MLflow and writes the adapter (runtime/distributed.py).
`--backend vllm`: every rollout from slmsql's vLLM engine serving the LoRA of that step (generation/vllm_rollouts.py,
training/vllm_trainer.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

from slmsql.configs import GRPOStageConfig
from slmsql.errors import SlmsqlError
from slmsql.inputs.data import db_path, read_gold, write_json
from slmsql.runtime.outputs import Staged

log = logging.getLogger(__name__)


# GRPO trains with every dropout module off (TRL's disable_dropout, set below on both backends): with dropout on, the
# old policy's log-probs that TRL takes in a separate pass (--backend vllm's importance-sampling correction,
# num_iterations > 1) draw other masks than the loss's, so the importance ratio is dropout noise, not 1; and the
# two backends would optimize different objectives (docs/stages/grpo.md, "Dropout").
DROPOUT_ON = ("trainer_args disable_dropout=false: GRPO trains with dropout off on both backends (TRL's old-policy "
              "log-probs, taken in a separate pass, would see other dropout masks than the loss and the importance "
              "ratio would measure dropout noise); remove it (docs/stages/grpo.md)")


def check_args(cfg: GRPOStageConfig, examples) -> None:
    from slmsql.generation import merged_rollouts, vllm_rollouts
    from slmsql.rewards.registry import check
    from slmsql.runtime import distributed
    from slmsql.training import grpo_variants

    check(cfg.rewards, cfg.reward_weights)
    grpo_variants.check(cfg, world_size=distributed.world_size())
    merged_rollouts.check(cfg)
    vllm_rollouts.check(cfg, world_size=distributed.world_size())
    if "disable_dropout" in cfg.trainer_args and not cfg.trainer_args["disable_dropout"]:
        raise SlmsqlError(DROPOUT_ON)
    if cfg.per_device_train_batch_size % cfg.num_generations:
        raise SlmsqlError(f"num_generations ({cfg.num_generations}) must divide per_device_train_batch_size "
                          f"({cfg.per_device_train_batch_size}): each batch holds whole groups")
    draw = cfg.questions_per_step(distributed.world_size())
    if len(examples) < draw.questions:
        raise SlmsqlError(
            f"{data_source(cfg.data)} holds {_questions(len(examples))}, fewer than one optimizer step draws: "
            f"{draw.questions} distinct questions ({draw.why}). TRL's sampler drops a last draw of fewer, so GRPO "
            "would make no optimizer step. Widen the band (more source questions, another --low/--high or k in the "
            "filter) or draw fewer questions a step (docs/stages/grpo.md, 'How many questions a step draws')")
    if cfg.trainer_args.get("use_vllm"):  # refused where it cannot run; TRL's version warning, said loudly
        from slmsql.generation.vllm_engine import check_trl

        if note := check_trl(cfg.trainer_args):
            log.warning(note)
    if "pass_rate" not in examples[0].extra:
        log.warning("%s has no pass_rate column: training on it as plain data, not a filtered band", cfg.data)


def data_source(data) -> str:
    """The RL data as a message names it: a run's artifact by its run URI and the run (a filter run said so), a
    filter's output folder as such, else the path."""
    from slmsql.tracking import runs as tracking

    if (uri := tracking.param_value(data)).startswith("runs:/"):
        import mlflow
        from mlflow.exceptions import MlflowException

        run_id = uri.split("/")[1]
        try:
            stage = mlflow.MlflowClient().get_run(run_id).data.tags.get("slmsql.stage")
        except MlflowException:
            stage = None
        return f"the RL data {uri} (from {'filter ' if stage == 'filter' else ''}run {run_id})"
    summary = Path(data).with_name("summary.json")
    if Path(data).name == "band.jsonl" and summary.is_file():
        try:
            n_source = f", {json.loads(summary.read_text())['n_source']} source questions"
        except (OSError, ValueError, KeyError, TypeError):
            n_source = ""
        return f"the RL data {data} (the band of the filter output folder {summary.parent}{n_source})"
    return f"the RL data {data}"


def made_a_step(cfg: GRPOStageConfig, trainer, n_questions: int) -> None:
    """Refuses a run that ended without an optimizer step: it trained nothing, so it is no result, and its adapter
    would be the policy it started from, which an evaluation would then compare with itself. check_args refuses
    the band too small for a step; this holds for any other way to none."""
    from slmsql.runtime import distributed

    if trainer.state.global_step == 0:
        raise SlmsqlError(f"GRPO made no optimizer step on {data_source(cfg.data)} ({_questions(n_questions)}; one "
                          f"step draws {cfg.questions_per_step(distributed.world_size())}): a run that trained "
                          "nothing is no result")


def _questions(n: int) -> str:
    return f"{n} question{'' if n == 1 else 's'}"


def reward_rows(cfg: GRPOStageConfig, examples) -> list[dict]:
    """TRL's conversational prompts; `sql`, `db_path` and `id` reach the reward functions as columns."""
    from slmsql.inputs.prompts import builder_for

    builder = builder_for(cfg)
    return [{"prompt": builder.messages(e), "sql": e.sql, "id": e.id, "db_path": str(db_path(cfg.db_root, e.db_id))}
            for e in examples]


def save(cfg, trainer, tokenizer, policy, work, outbox, summary: dict, *, model_id, merged) -> None:
    """The adapter (PEFT format) + tokenizer + resolved config, logged to the run; by the main process only (every
    process holds the same weights after the last synchronised step)."""
    from slmsql.stats import wording
    from slmsql.tracking import descriptions, figures
    from slmsql.tracking import runs as tracking
    from slmsql.training import hf_trainer

    final = work / "adapter"
    hf_trainer.save_policy(trainer.model, tokenizer, final)
    # its prompt settings; a LoRA records the plain base model, so what it was trained on top of is kept beside it
    # (policy/models.py, `merged`); a full model stacked on a merged adapter holds that adapter already (None)
    policy.record(final, merged=merged)
    write_json(final / "slmsql_grpo_config.json", tracking.portable_config(cfg))
    outbox.log_metrics(summary)
    outbox.set_tag(tracking.NOTE, descriptions.grpo_note(summary))
    outbox.set_tag(tracking.RESULT, wording.signal_result(summary))
    if (curves := figures.training_curves(trainer.state.log_history)) is not None:
        outbox.log_figure(curves, "training_curves.png")
    outbox.log_artifacts(final, "adapter")
    if model_id:  # an adapter, a few megabytes: the model's own files too (a full model stays the run's artifact)
        outbox.log_model_artifact(model_id, final)
    write_json(work / "summary.json", summary)
    outbox.log_artifact(work / "summary.json")


def main(cfg: GRPOStageConfig) -> dict:
    import mlflow
    from datasets import Dataset
    from trl import GRPOConfig

    from slmsql.generation import merged_rollouts, vllm_engine, vllm_rollouts
    from slmsql.training import merged_rollouts_trainer
    from slmsql.policy.resolve import Policy
    from slmsql.rewards import registry as rewards
    from slmsql.runtime import distributed
    from slmsql.sql.sandbox import Limits, SandboxPool
    from slmsql.tracking import durable, lineage, tables
    from slmsql.tracking import runs as tracking
    from slmsql.training import grpo_variants, hf_trainer, shared_prefix_trainer, vllm_trainer

    # args: data, rewards, batch shape and adapter are all checked before any model loads
    examples = read_gold(cfg.data)
    missing = sorted({e.db_id for e in examples if not db_path(cfg.db_root, e.db_id).is_file()})
    if missing:
        raise SlmsqlError(f"{cfg.data}: no database for db_id {missing[:5]} under {cfg.db_root}")
    check_args(cfg, examples)
    policy = Policy.resolve(cfg, cfg.base_adapter)  # the base, the adapter GRPO starts from, their prompt settings
    token_metrics = policy.check_prompts(cfg, examples, new_tokens=cfg.max_completion_length)
    identity = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("resume", "overwrite", "run_name")}
    identity["world_size"] = distributed.world_size()  # the global batch, hence the run, depends on it
    st = Staged(cfg.output_dir, cfg.overwrite, identity=identity, resume=cfg.resume)
    # also refuses unknown or slmsql-owned trainer_args, before any model loads; under a launcher it also
    # initialises the process group, which the output folder and the run below coordinate through
    args = hf_trainer.trl_config(
        GRPOConfig, cfg, st.work, save_strategy="steps", log_completions=True, num_completions_to_print=0,
        gradient_checkpointing=False, disable_dropout=True)  # DROPOUT_ON: the new LoRA's and a continued one's
    if note := vllm_rollouts.preflight(cfg, args, token_metrics["tokens/prompt_max"]):  # refuses what cannot fit
        log.info(note)
    # adapter_mode only means something with a base adapter: no tag (the card reads "none") rather than one
    # that contradicts the param (its default)
    tags = {**policy.tags("slmsql.base_adapter"), "slmsql.adapter_mode": cfg.adapter_mode if cfg.base_adapter else ""}

    # what the run logs from here on survives a tracking outage; the outbox waits for the server only once the
    # adapter is in its final folder (it exits last)
    outbox = durable.Outbox(durable.folder_for(cfg.output_dir))
    params = {**policy.params(), **vllm_engine.run_params(cfg)}
    with outbox, st, tracking.stage_run("grpo", cfg, params, tags=tags, run_id=st.run_id, system_metrics=True,
                                        outbox=outbox) as run, \
            SandboxPool(cfg.workers or None, Limits(timeout_s=cfg.timeout_s)) as pool:
        st.bind(run.info.run_id)
        work, main = st.work, distributed.is_main()
        rows = reward_rows(cfg, examples)  # data
        continue_adapter = bool(cfg.base_adapter) and cfg.adapter_mode == "continue"
        peft = cfg.use_lora or continue_adapter  # else a full model (no LoRA, or stacked on a merged adapter)
        if main:  # the policy's LoggedModel (a resumed run keeps its own), finalized with the run
            model_id = lineage.start_policy_model(run.info.run_id, cfg.run_name or "grpo", "adapter", adapter=peft)
            outbox.track_model(model_id)
            tracking.log_dataset([e.to_json() for e in examples], "rl", cfg.data, context="training")
            mlflow.log_metrics(token_metrics)

        # model: continue the SFT adapter, or merge it and stack a new one, or a fresh LoRA / full model
        model, tokenizer = policy.load_to_train(merge_adapter=bool(cfg.base_adapter) and not continue_adapter)
        peft_config = hf_trainer.lora_config(cfg) if cfg.use_lora and not continue_adapter else None

        # rewards: registry functions bound to this run's sandbox and tiers (and, for the correctness-aware
        # options, to the hook through which the trainer reads each completion's execution outcome)
        tiers = rewards.Tiers(runs=cfg.runs_tier, format=cfg.format_tier)
        Trainer, hooks = grpo_variants.trainer_class(cfg)
        reward_funcs = rewards.build(cfg.rewards, executor=pool, tiers=tiers, match=cfg.match, **hooks)

        # trainer: TRL's GRPOTrainer, or its correctness-aware subclass (grpo_variants) when an option asks; each
        # prompt computed once per micro-batch and prefilled once (shared_prefix_trainer), its state in a tag
        hf_trainer.compact_fused_head()
        if cfg.shared_prefix:
            Trainer = shared_prefix_trainer.trainer_class(
                Trainer, on_state=(lambda text: outbox.set_tag(shared_prefix_trainer.TAG, text)) if main else None)
        if cfg.merged_rollouts:  # rollouts sampled with the LoRA merged, the base tensors put back after
            Trainer = merged_rollouts_trainer.trainer_class(
                Trainer, on_state=(lambda text: outbox.set_tag(merged_rollouts.TAG, text)) if main else None)
        # --backend vllm: every rollout from slmsql's vLLM engine, the LoRA of each step swapped in (vllm_trainer)
        Trainer = vllm_trainer.trainer_for(cfg, Trainer, work, model, tokenizer, token_metrics["tokens/prompt_max"])
        trainer = Trainer(model=model, reward_funcs=reward_funcs, args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          peft_config=peft_config,
                          callbacks=[hf_trainer.metrics_callback(outbox),
                                     hf_trainer.completions_logger(outbox, work, cfg.completions_every, {
                                         tables.prompt_key(r["prompt"]): e for r, e in zip(rows, examples)},
                                         cfg.rewards)])
        hf_trainer.quiet_progress(trainer)
        t0 = time.time()
        # the main process picks the checkpoint, so every process resumes from the same one
        resume_from = distributed.from_main(lambda: hf_trainer.last_checkpoint(work)) if cfg.resume else None
        trainer.train(resume_from_checkpoint=resume_from)
        made_a_step(cfg, trainer, len(rows))  # else the run fails

        # save: by the main process only
        summary = {**hf_trainer.summary_metrics(trainer.state.log_history), "train_seconds": time.time() - t0,
                   "steps": trainer.state.global_step}
        if resume_from:  # train_seconds timed only the steps after the checkpoint: say from where
            summary["resumed_at_step"] = int(Path(resume_from).name.rsplit("-", 1)[1])
        if main:
            save(cfg, trainer, tokenizer, policy, work, outbox, summary, model_id=model_id if peft else None,
                 merged=not continue_adapter if continue_adapter or peft_config is not None else None)
    log.info("GRPO done: %s", json.dumps(summary))
    return summary

