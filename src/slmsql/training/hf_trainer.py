"""What the training stages (sft, grpo) share: TRL config from a stage config, precision, LoRA, callbacks.

TRL config rule (`trl_config`), in increasing precedence:
1. the stage's own settings for TRL fields slmsql has no option for (e.g. SFT's cosine schedule, GRPO's
   `save_strategy="steps"`, `gradient_checkpointing=False`, precision from the device);
2. every field of the stage config that the TRL config class also has (`learning_rate`, `max_steps`, ...):
   adding a TRL option to slmsql is one field in `configs.py`;
3. `--trainer-args key=value` for any other TRL field: the command line wins over (1).
A trainer arg that names an slmsql option (use the option: one value, one place) or a field slmsql must own
(where outputs go, what reports where) is refused before any model loads, as is a field TRL does not have.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from slmsql.configs import to_params
from slmsql.errors import SlmsqlError
from slmsql.runtime import distributed

log = logging.getLogger(__name__)
OWNED = {"output_dir": "the stage's staging folder", "run_name": "the MLflow run name (--run-name)",
         "report_to": "slmsql's own MLflow callback (report_to=mlflow would log ~224 params)",
         "logging_dir": "the staging folder"}


def device_args(dtype: str = "auto") -> dict:
    """TRL configs default to bf16, which transformers refuses on a CPU: train in the stage's --dtype as
    models.load_model resolves it (auto: bf16 on a GPU that has it, else fp32). Refuses fp16 on a CPU."""
    import torch

    from slmsql.policy.models import dtype_name

    name = dtype_name(dtype)
    return {"use_cpu": not torch.cuda.is_available(), "bf16": name == "bfloat16", "fp16": name == "float16"}


def trl_config(trl_cls, cfg, work: Path, **stage_settings):
    """Build `trl_cls` (GRPOConfig, SFTConfig) from a stage config by the rule in the module docstring."""
    known = {f.name for f in dataclasses.fields(trl_cls)}
    ours = {f.name for f in dataclasses.fields(cfg)}
    extra = dict(cfg.trainer_args)
    for key in extra:
        if key in OWNED:
            raise SlmsqlError(f"trainer_args: {key} is set by slmsql ({OWNED[key]})")
        if key in ours:
            raise SlmsqlError(f"trainer_args: {key} is an slmsql option; set it with --{key.replace('_', '-')}")
        if key not in known:
            raise SlmsqlError(f"trainer_args: {trl_cls.__name__} has no field {key!r}")
    passed = {k: getattr(cfg, k) for k in ours & known if k not in OWNED}
    passed = {k: (v if v != [] else None) for k, v in passed.items()}  # an empty list option means "TRL's default"
    settings = {**device_args(getattr(cfg, "dtype", "auto")), **stage_settings, **passed, **extra}
    try:
        args = trl_cls(output_dir=str(work), report_to="none", **settings)
    except (TypeError, ValueError) as e:
        raise SlmsqlError(f"{trl_cls.__name__}: {e}") from None
    # Under a launcher, building the config has just initialised the process group: before any process
    # touches the output folder or the run, check that all of them resolved the same config (the main
    # process logs its own as the run's params).
    distributed.check_same("config", to_params(cfg))
    return args


# the TRL releases whose `trl.trainer.utils._use_triton` compact_fused_head was read and measured against
COMPACT_HEAD_TRL = ("1.16.0",)


def compact_fused_head() -> None:
    """Make TRL's fused LM head project only the positions that carry a label on a CPU too.

    TRL (SFT and GRPO) computes per-token log-probabilities, entropy and accuracy with a fused LM head that never
    builds the (tokens x vocabulary) logits. On CUDA/XPU it projects only the positions with a label; elsewhere
    every position, prompt and padding included, so that a compiled backend (Neuron) sees fixed tile shapes. On a
    CPU in eager mode that only multiplies the work: the toy SFT's completions are 21 of ~167 tokens, and the head
    was ~55% of a step (bench/README.md, lifecycle.py). The values are the same either way (unlabelled positions
    are zero). TRL 1.16 decides it with `trl.trainer.utils._use_triton` alone (its kernels' own choice of Triton
    or torch lives in `trl.kernels.chunked_logprob` and is left alone). That name is TRL's private one: only in
    the releases it was checked on (COMPACT_HEAD_TRL) is it replaced; any other TRL is left as it is, with a
    warning that the speed-up is off (another release may use the name for something else, or decide elsewhere)."""
    import trl
    from trl.trainer import utils as trl_utils

    decide = getattr(trl_utils, "_use_triton", None)
    if getattr(decide, "slmsql_compact", False):
        return
    if trl.__version__ not in COMPACT_HEAD_TRL or decide is None:
        log.warning("TRL %s is not a release slmsql's compact fused LM head was checked on (%s): left as TRL has it, "
                    "so on a CPU its head projects every position (slower, same values)", trl.__version__,
                    ", ".join(COMPACT_HEAD_TRL))
        return

    def compact(device) -> bool:
        return device.type == "cpu" or decide(device)

    compact.slmsql_compact = True
    trl_utils._use_triton = compact


def lora_config(cfg):
    from peft import LoraConfig

    targets = "all-linear" if cfg.target_modules == ["all-linear"] else cfg.target_modules
    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM")


# The MLflow UI draws a run's charts in sections named by the metric's prefix, in name order, and TRL's names put
# five clip-ratio charts first and reward at the bottom. So the learning signal is also logged as
# `0_signal/<metric>` (vocabulary.SIGNAL; a digit sorts before every letter), and the clip ratios, 0 by
# construction while each generation batch is trained on once, are held back until they move (then logged from
# their first step).
HELD_WHILE_CONSTANT = ("clip_ratio/",)


class StepMetrics:
    """A step's trainer metrics as logged (names made MLflow-safe, the rules above): `points(logs, step)` returns
    [(step, {name: value})], the held-back points of a metric first when it moves."""

    def __init__(self):
        self.held: dict[str, list[tuple[int, float]]] = {}
        self.moving: set[str] = set()

    def points(self, logs: dict, step: int) -> list[tuple[int, dict]]:
        from slmsql.tracking.runs import metric_name, numeric
        from slmsql.tracking.vocabulary import SIGNAL, SIGNAL_PREFIX

        now, earlier = {}, []
        for key, value in numeric(logs).items():
            name = metric_name(key)
            if name.startswith(HELD_WHILE_CONSTANT) and name not in self.moving:
                held = self.held.setdefault(name, [])
                if all(v == value for _, v in held):
                    held.append((step, value))
                    continue
                self.moving.add(name)
                earlier += [(s, {name: v}) for s, v in self.held.pop(name)]
            now[name] = value
            if key in SIGNAL:
                now[f"{SIGNAL_PREFIX}/{name}"] = value
        return earlier + ([(step, now)] if now else [])


def metrics_callback(outbox):
    """A transformers callback logging the trainer's metrics (`StepMetrics`) to the stage's run through its outbox
    (tracking/durable.py: an outage loses none), and nothing else: `report_to="mlflow"` would also log ~224 params
    (every training argument and model-config field)."""
    from transformers import TrainerCallback

    class MlflowMetrics(TrainerCallback):
        def __init__(self):
            self.steps = StepMetrics()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs:
                for step, metrics in self.steps.points(logs, state.global_step):
                    outbox.log_metrics(metrics, step=step)

    return MlflowMetrics()


def completions_logger(outbox, output_dir: Path, every: int, questions: dict | None = None,
                       rewards: list[str] = ()):
    """Ship TRL's per-step completions parquet to MLflow (through the stage's outbox) as a readable table
    every `every` steps
    (`tables.completions_table`: question, extracted SQL, completion, gold SQL, status, rewards, advantage;
    `questions` maps a prompt's key to its Example).

    TRL writes `completions/completions_<step>.parquet` only after the callbacks' on_log for that step, so
    each on_log ships the files that exist by then (the last one at the end-of-training log). A `.logged`
    marker keeps a resumed run from shipping a file twice (the outbox holds it from then on)."""
    from transformers import TrainerCallback

    from slmsql.tracking.tables import completions_table

    class CompletionsToMlflow(TrainerCallback):
        def _ship(self, state):
            import pandas as pd

            if not state.is_world_process_zero:
                return
            for path in sorted((output_dir / "completions").glob("completions_*.parquet")):
                step, marker = int(path.stem.rsplit("_", 1)[1]), path.with_suffix(".logged")
                if step % every or marker.exists():
                    continue
                table = completions_table(pd.read_parquet(path), questions or {}, list(rewards))
                outbox.log_table(table, f"completions/step_{step:05d}.json")
                marker.touch()

        def on_log(self, args, state, control, **kwargs):
            self._ship(state)

        def on_train_end(self, args, state, control, **kwargs):
            self._ship(state)

    return CompletionsToMlflow()


def quiet_progress(trainer) -> None:
    """Keep the trainer's progress bar but stop it printing every log dict to stdout (MLflow has them)."""
    from transformers.trainer_callback import ProgressCallback

    class BarOnly(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            pass

    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(BarOnly())


def summary_metrics(log_history: list[dict]) -> dict:
    """Means over the run of the signals that separate 'no gradient signal' from 'signal, no gain', as
    `summary/<metric>` (vocabulary.SUMMARY_OF)."""
    from slmsql.tracking.vocabulary import SUMMARY_OF

    out = {}
    for key in SUMMARY_OF:
        vals = [h[key] for h in log_history if isinstance(h.get(key), (int, float))]
        if vals:
            out[f"summary/{key}"] = sum(vals) / len(vals)
    return out


def save_policy(model, tokenizer, folder: Path) -> None:
    """The trained policy and its tokenizer, without the README.md PEFT writes into an adapter folder: that
    boilerplate ("More Information Needed") would pass for a model card; publish writes the real one. An
    adapter's base as every machine names it (`tracking.portable`: a fetched run artifact as its run URI), not
    the folder it was loaded from here."""
    import json

    from slmsql.inputs.data import write_json
    from slmsql.tracking.runs import portable

    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    readme = Path(folder) / "README.md"
    if readme.is_file() and "More Information Needed" in readme.read_text(encoding="utf-8", errors="replace"):
        readme.unlink()
    config = Path(folder) / "adapter_config.json"
    if config.is_file() and (base := json.loads(config.read_text()).get("base_model_name_or_path")):
        write_json(config, {**json.loads(config.read_text()), "base_model_name_or_path": portable(base)})


def last_checkpoint(work: Path):
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(str(work))
