"""SFT: TRL SFTTrainer on gold-format data (prompt -> ```sql answer), LoRA or full fine-tuning.

args -> data -> model -> trainer -> save. The output folder is a loadable policy: a full model
(`--model OUT`) or a PEFT adapter (`--adapter OUT`), with the tokenizer, either way.
Under torchrun / `accelerate launch` every process trains on its share of each batch; the main process alone
logs to MLflow and writes the policy (runtime/distributed.py).
"""

from __future__ import annotations

import logging
import time

from slmsql.configs import SFTStageConfig
from slmsql.errors import SlmsqlError
from slmsql.inputs.data import check_databases, read_gold, write_json
from slmsql.inputs.prompts import answer, builder_for
from slmsql.runtime.outputs import Staged

log = logging.getLogger(__name__)


def conversations(cfg, examples) -> list[dict]:
    """TRL's conversational prompt-completion rows: loss falls on the completion only."""
    builder = builder_for(cfg)
    return [{"prompt": builder.messages(ex), "completion": [{"role": "assistant", "content": answer(ex.sql)}]}
            for ex in examples]


def main(cfg: SFTStageConfig) -> dict:
    import mlflow
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from slmsql.inputs import tokens
    from slmsql.policy.models import STACK_BASE
    from slmsql.policy.resolve import Policy
    from slmsql.runtime import distributed
    from slmsql.stats import wording
    from slmsql.tracking import descriptions, durable, lineage
    from slmsql.tracking import runs as tracking
    from slmsql.training import hf_trainer

    # args: every check before any model loads, the token budget and the prompt settings included
    examples = read_gold(cfg.data)
    check_databases(examples, cfg.db_root, cfg.data)
    st = Staged(cfg.output_dir, cfg.overwrite)
    policy = Policy.resolve(cfg, cfg.base_adapter)  # the base, the adapter SFT continues, their prompt settings
    rows = conversations(cfg, examples)
    keep, token_metrics = tokens.check_sft(policy.tokenizer, rows, [e.id for e in examples], max_length=cfg.max_length,
                                           drop=cfg.drop_long, source=cfg.data)
    # also refuses unknown or slmsql-owned trainer_args, before any model loads; under a launcher it also
    # initialises the process group, which the output folder and the run below coordinate through
    args = hf_trainer.trl_config(
        SFTConfig, cfg, st.work / "checkpoints", lr_scheduler_type="cosine",
        warmup_steps=min(30, cfg.max_steps // 10), logging_steps=max(1, cfg.max_steps // 50), save_strategy="no",
        gradient_checkpointing=False, dataloader_num_workers=0)

    # what the run logs from here on survives a tracking outage; the outbox waits for the server only once the
    # policy is in its final folder (it exits last)
    outbox = durable.Outbox(durable.folder_for(cfg.output_dir))
    with outbox, st, tracking.stage_run("sft", cfg, policy.params(), tags=policy.tags("slmsql.base_adapter"),
                                        system_metrics=True, outbox=outbox) as run:
        # data
        train = Dataset.from_list([rows[j] for j in keep])
        main = distributed.is_main()
        peft = bool(cfg.use_lora or cfg.base_adapter)  # else a full fine-tune
        if main:  # the policy's LoggedModel, finalized with the run (its files: the run's `policy` artifact)
            model_id = lineage.start_policy_model(run.info.run_id, cfg.run_name or "sft", "policy", adapter=peft)
            outbox.track_model(model_id)
            tracking.log_dataset([e.to_json() for e in examples], "sft", cfg.data, context="training")
            mlflow.log_metrics(token_metrics)
        # model
        model, tokenizer = policy.load_to_train()
        tokenizer.padding_side = "right"  # training pads right; generation (load_model's default) pads left
        peft_config = hf_trainer.lora_config(cfg) if cfg.use_lora and not cfg.base_adapter else None
        # trainer
        hf_trainer.compact_fused_head()
        trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer,
                             peft_config=peft_config, callbacks=[hf_trainer.metrics_callback(outbox)])
        hf_trainer.quiet_progress(trainer)
        t0 = time.time()
        result = trainer.train()
        if trainer.state.global_step == 0:
            raise SlmsqlError("SFT made no optimizer step: is the data empty or max_steps 0?")
        work = st.work
        summary = {"train_loss": result.training_loss, "train_seconds": time.time() - t0,
                   "steps": trainer.state.global_step, "examples": len(keep),
                   "kind": "adapter" if peft else "full"}
        # save: an adapter when LoRA, else the full model; the tokenizer beside it either way. By the main
        # process only: every process holds the same weights after the last synchronised step.
        if main:
            if (work / "checkpoints").is_dir() and not any((work / "checkpoints").iterdir()):
                (work / "checkpoints").rmdir()
            tokenizer.padding_side = "left"
            hf_trainer.save_policy(trainer.model, tokenizer, work)
            # its prompt settings; continuing a stacked adapter keeps what it was stacked on (policy/models.py)
            policy.record(work, merged=False)
            write_json(work / "sft_summary.json", summary)
            outbox.log_metrics(tracking.numeric(summary))
            outbox.set_tag("slmsql.policy_kind", summary["kind"])
            outbox.set_tag(tracking.NOTE, descriptions.sft_note(summary, cfg.model))
            outbox.set_tag(tracking.RESULT, wording.sft_result(summary))
            for f in work.iterdir():  # the policy, so later stages can load it by run URI; not the checkpoints
                if f.is_file():
                    outbox.log_artifact(f, "policy")
                elif f.name == STACK_BASE:
                    outbox.log_artifacts(f, f"policy/{STACK_BASE}")
                if peft and (f.is_file() or f.name == STACK_BASE):  # an adapter: the model's own files too
                    outbox.log_model_artifact(model_id, f, "policy")
    log.info("SFT done: %d steps in %.0f s, loss %.3f -> %s", summary["steps"], summary["train_seconds"],
             summary["train_loss"], cfg.output_dir)
    return summary
