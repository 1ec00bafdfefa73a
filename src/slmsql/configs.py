"""One config system for the CLI, MLproject and recipes.

Each stage's parameters are a dataclass; each field carries its help text. From that single definition:
- the CLI options (`slmsql <stage> --field-name ...`) are generated (`cli.py`),
- MLproject's typed parameters are generated (`slmsql mlproject`, checked in sync by a test),
- YAML recipes under `recipes/` set any field by name.
List options (`list[str]`, `list[float]`) are written comma-separated on the command line and in MLproject,
as YAML lists or comma-separated strings in recipes, and parsed here, once.
Precedence: field default < recipe < command-line value; recipes stack (`--recipe A.yaml,B.yaml`: B's keys
win). Under `mlflow run` (which passes every MLproject parameter, defaults included) a value equal to the
field's default does not override the recipe.
`trainer_args` passes any further TRL config field (GRPOConfig / SFTConfig) through (training.trl_config).
`STAGES` is the one list of commands: the CLI, MLproject, the stage modules (`stages/<name>.py`) and the runs
table (each config's `key_metrics`) all come from it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import yaml

from slmsql.errors import DataError, SlmsqlError


def opt(default, help: str, **meta):
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class Common:
    key_metrics: ClassVar = ()  # what `slmsql runs` shows for this stage
    # Whether the stage runs as several processes under torchrun / `accelerate launch` (one MLflow run, one
    # output: see runtime/distributed.py); the others refuse such a launch.
    multiprocess: ClassVar = False
    output_dir: str = opt("outputs/run", "Folder for this stage's outputs (refused if not empty unless --overwrite).")
    overwrite: bool = opt(False, "Allow writing into a non-empty output folder.")
    experiment: str = opt("slmsql", "MLflow experiment name.")
    run_name: str = opt("", "MLflow run name (default: the stage name).")
    seed: int = opt(0, "Random seed for sampling and training.")

    def __post_init__(self):
        # A list option built from Python with a comma-separated string (as MLflow params hold it) is parsed
        # by the same rule as the command line's.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, str) and list_type(typing.get_type_hints(type(self))[f.name]):
                setattr(self, f.name, coerce(type(self), f.name, value))


@dataclass
class Workers:
    timeout_s: float = opt(5.0, "Per-query execution deadline in seconds.")
    workers: int = opt(0, "Sandbox worker processes (0 = one per CPU core; launched as several processes, "
                          "each one's share).")
    match: str = opt("bird", "Answer matching: bird (set semantics), spider (test-suite multiset semantics, on "
                     "<db_root>/<db_id>/<db_id>.sqlite) or test-suite (spider's rules on every *.sqlite in "
                     "<db_root>/<db_id>/: right only if right on all of them).",
                     choices=("bird", "spider", "test-suite"))


@dataclass
class Engine:
    """Where filter and evaluate run their generation and scoring (`engines`): same rows either way."""

    engine: str = opt("local", "local (this process and one sandbox pool) or ray (Ray Data actors for generation "
                      "and scoring; pip install -e '.[ray]').", choices=("local", "ray"))
    ray_address: str = opt("", "Ray cluster to join with --engine ray: empty starts a local Ray in this process; "
                           "auto, HOST:PORT or ray://HOST:PORT joins a running one.")
    ray_generators: int = opt(1, "Ray: generation actors (each loads the model once).")
    ray_gpus_per_generator: float = opt(0.0, "Ray: GPUs per generation actor (0: CPU; 1 per GPU; fractions share one).")
    ray_cpus_per_generator: float = opt(1.0, "Ray: CPUs reserved per generation actor.")
    ray_scorers: int = opt(1, "Ray: scoring actors, each with its own sandbox pool.")
    ray_cpus_per_scorer: float = opt(1.0, "Ray: CPUs reserved per scoring actor; its sandbox pool runs --workers "
                                     "processes (0: this many).")
    ray_score_batch: int = opt(16, "Ray: questions per scoring batch (generation batches are --batch-size).")

    def __post_init__(self):
        super().__post_init__()
        for name in ("ray_generators", "ray_scorers", "ray_score_batch"):
            if getattr(self, name) < 1:
                raise DataError(f"must be >= 1, got {getattr(self, name)}", "config", field=name)
        for name in ("ray_gpus_per_generator", "ray_cpus_per_generator", "ray_cpus_per_scorer"):
            if getattr(self, name) < 0:
                raise DataError(f"must be >= 0, got {getattr(self, name)}", "config", field=name)


@dataclass
class Prompt:
    prompt_style: str = opt("compact", "Schema prompt: compact (one line per table, the tiny model) or omnisql "
                            "(OmniSQL's CREATE TABLE format with example values, for Qwen2.5-Coder).",
                            choices=("compact", "omnisql"))
    example_values: int = opt(0, "Example values per column in omnisql-style prompts.")
    tables_json: str = opt("", "Spider/BIRD tables.json: schemas of the databases it lists come from it (original "
                           "names, no example values), the others from their .sqlite files.")


@dataclass
class PolicyPrompt(Prompt):
    """Prompt settings of a stage that prompts a trained policy: they must be those it was trained on."""

    allow_prompt_change: bool = opt(False, "Build prompts other than those the policy was trained on (its "
                                    "slmsql_prompt.json): refused otherwise.")


@dataclass
class Precision:
    dtype: str = opt("auto", "Weights' precision: auto (float32 on CPU, bfloat16 on a GPU that supports it, else "
                     "float32), float32, bfloat16 or float16 (GPU only). Training stages train in it (TRL's "
                     "bf16/fp16). The resolved choice is the run's slmsql.dtype tag.",
                     choices=("auto", "float32", "bfloat16", "float16"))


@dataclass
class Backend:
    backend: str = opt("transformers", "Generation backend: transformers or vllm (when installed). GRPO: every "
                       "rollout from slmsql's vLLM engine, the LoRA of each step served as a new LoRARequest.",
                       choices=("transformers", "vllm"))


@dataclass
class Model(Backend, Precision, PolicyPrompt):
    model: str = opt("", "Base model: a Hub id or a local path (default: the embedded tiny model).")
    adapter: str = opt("", "Optional PEFT adapter (path) applied on top of the model.")
    batch_size: int = opt(16, "Prompts per generation batch.")
    shared_schema: bool = opt(True, "transformers: batch the questions whose prompts share a token prefix (their "
                              "database's schema) together, compute that prefix once per group and generate each "
                              "question from a copy of its cache (the same computation in another float order). "
                              "false: every prompt computed whole. vLLM shares prefixes itself (prefix caching).")
    max_new_tokens: int = opt(128, "Generation budget per completion.")
    db_ids: list[str] = opt([], "Use only the questions on these databases (comma-separated db_ids; empty: all), "
                            "before --limit: a split of a benchmark by database.")
    limit: int = opt(0, "Use only the first N questions of --data (0: all).")


@dataclass
class Sampling:
    """The sampling distribution of the filter's K samples and of GRPO's rollouts: one set of fields mixed into
    both, so the band is measured under the distribution GRPO trains with. Each is passed explicitly (to TRL's
    GRPOConfig field of the same name, to generation/sampling.py's sampler), so a checkpoint's generation_config.json
    (Qwen instruct: top_p 0.8, top_k 20, repetition_penalty 1.05) never fills one in. Evaluate is greedy."""

    temperature: float = opt(0.8, "Sampling temperature.")
    top_p: float = opt(1.0, "Nucleus sampling p (1: off).")
    top_k: int = opt(0, "Top-k sampling (0: off).")
    min_p: float = opt(0.0, "Min-p sampling (0: off).")
    repetition_penalty: float = opt(1.0, "Repetition penalty on prompt and completion tokens (1: off).")

    def __post_init__(self):
        super().__post_init__()
        for name, ok, want in (("temperature", self.temperature > 0, "> 0"),
                               ("top_p", 0 < self.top_p <= 1, "in (0, 1]"), ("top_k", self.top_k >= 0, ">= 0"),
                               ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
                               ("repetition_penalty", self.repetition_penalty > 0, "> 0")):
            if not ok:
                raise DataError(f"must be {want}, got {getattr(self, name)}", "config", field=name)

    def sampling(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Sampling)}


@dataclass
class ToyConfig(Common):
    """Generate the embedded toy world: SQLite databases and gold questions in four splits."""

    key_metrics: ClassVar = ("sft_total", "dev_total", "dev_cross_total")

    size: str = opt("small", "Toy world size.", choices=("small", "medium", "large"))
    output_dir: str = opt("outputs/toy", "Folder for the toy world.")


@dataclass
class TinyModelConfig(Prompt, Common):
    """Build the embedded default model: a tiny Qwen2 with a tokenizer trained on the toy world."""

    key_metrics: ClassVar = ("parameters",)

    data: str = opt("outputs/toy", "Toy world folder whose texts train the tokenizer.")
    output_dir: str = opt("outputs/tiny-model", "Folder for the model and tokenizer.")
    vocab_size: int = opt(2000, "BPE vocabulary size.")
    hidden: int = opt(128, "Hidden size.")
    layers: int = opt(2, "Decoder layers.")
    heads: int = opt(4, "Attention heads.")
    ffn: int = opt(512, "Feed-forward size.")


@dataclass
class EvaluateConfig(Model, Workers, Engine, Common):
    """Execution accuracy of a model or a predictions file, with intervals and a paired test."""

    key_metrics: ClassVar = ("ex", "ex_ci_low", "ex_ci_high", "vs_baseline/diff", "vs_baseline/p")

    data: str = opt("", "Gold file: canonical JSONL, or BIRD/Spider dev.json.", required=True)
    db_root: str = opt("", "Folder holding <db_id>/<db_id>.sqlite.", required=True)
    predictions: str = opt("", "Score this predictions JSONL ({id, sql} or {id, completion}) instead of a model.")
    baseline_run: str = opt("", "MLflow run id of the baseline evaluation for the paired comparison.")
    alpha: float = opt(0.05, "Significance level of the paired test.")
    dataset_name: str = opt("", "Dataset name for tags and the card (default: the data file's stem).")
    output_dir: str = opt("outputs/evaluate", "Folder for results.jsonl, metrics.json, predictions.jsonl.")
    answer_prefix: str = opt("", "Text the model's answer is made to start with (e.g. '```sql\\n': the query "
                             "at once, no explanation first), appended to every prompt and put back in front of "
                             "every completion. A different measurement from the model's own answers, logged as "
                             "the run's answer_prefix parameter: say so wherever its figure goes. Empty: the "
                             "model's own answers.")


@dataclass
class Lora:
    use_lora: bool = opt(True, "Train a LoRA adapter (else full fine-tuning).")
    lora_r: int = opt(32, "LoRA rank.")
    lora_alpha: int = opt(64, "LoRA alpha (scale).")
    lora_dropout: float = opt(0.05, "LoRA dropout.")
    target_modules: list[str] = opt(["all-linear"], "LoRA target modules (comma-separated, or all-linear).")
    trainer_args: dict = opt({}, "Extra TRL config fields, e.g. 'warmup_steps=0.1 bf16=true'.")


@dataclass
class SFTStageConfig(Lora, Precision, PolicyPrompt, Common):
    """Supervised fine-tuning (TRL SFTTrainer) on gold-format data, LoRA or full."""

    key_metrics: ClassVar = ("train_loss", "steps")
    multiprocess: ClassVar = True

    data: str = opt("outputs/toy/sft.jsonl", "Training data in gold format.")
    db_root: str = opt("outputs/toy/databases", "Database folder (schemas for the prompts).")
    model: str = opt("outputs/tiny-model", "Base model: Hub id or local path.")
    base_adapter: str = opt("", "Continue training this adapter (a previous SFT stage).")
    use_lora: bool = opt(False, "Train a LoRA adapter (else full fine-tuning; the tiny model trains fully).")
    learning_rate: float = opt(3e-3, "Peak learning rate.")
    max_steps: int = opt(800, "Optimizer steps.")
    per_device_train_batch_size: int = opt(16, "Batch size.")
    max_length: int = opt(384, "Longest example (prompt + answer, in the model's tokens): a longer one is refused, "
                          "since truncation would cut its answer.")
    drop_long: bool = opt(False, "Leave out examples longer than --max-length (counted, logged) instead of refusing.")
    output_dir: str = opt("outputs/sft", "Folder for the trained policy.")


@dataclass
class GRPOStageConfig(Lora, Sampling, Workers, Backend, Precision, PolicyPrompt, Common):
    """GRPO (TRL GRPOTrainer) with the execution reward, LoRA and telemetry."""

    key_metrics: ClassVar = ("summary/frac_reward_zero_std", "summary/reward_std",
                             "summary/exec/frac_groups_correctness_varies", "steps")
    multiprocess: ClassVar = True

    data: str = opt("outputs/filter/band.jsonl", "RL data (a filter band file or any gold file).")
    db_root: str = opt("outputs/toy/databases", "Database folder.")
    model: str = opt("outputs/sft", "Base model: Hub id or local path.")
    base_adapter: str = opt("", "SFT adapter to start from.")
    adapter_mode: str = opt("continue", "continue: train the base adapter further; stack: merge it, train a new one.",
                            choices=("continue", "stack"), only_with="base_adapter")
    rewards: list[str] = opt(["execution", "format"], "Comma-separated reward names from the registry: "
                             "execution, format, syntax, schema_linking, ngram, cell_precision, cell_recall, "
                             "tuple_cardinality (docs/stages/grpo.md: what each measures; recipes/rewards/: sets).")
    reward_weights: list[float] = opt([], "Comma-separated weights, one per reward (default: all 1): TRL sums the "
                                      "weighted rewards.")
    runs_tier: float = opt(0.1, "Execution reward for SQL that runs but is wrong.")
    format_tier: float = opt(0.2, "Format reward for a ```sql block.")
    num_generations: int = opt(8, "Completions per prompt (the GRPO group).")
    shared_prefix: bool = opt(True, "Compute each distinct prompt of a micro-batch once in training (its completions "
                              "attend to it; exact, checked against the plain path at the first step) and prefill it "
                              "once in generation. false: TRL's plain path, every prompt forwarded G times.")
    merged_rollouts: bool = opt(False, "Sample the transformers rollouts with the LoRA merged into the base weights "
                                "(fewer matmuls a decode step), the base tensors restored untouched after: training "
                                "is unchanged bit for bit, sampling differs by float error (the first rollout's "
                                "log-prob gap is logged). float32 LoRA only; not with --backend vllm.")
    advantage_gate: str = opt("none", "correctness: a group whose completions are all correct or all wrong gets "
                              "advantage 0, whatever its shaped rewards (none: TRL's advantages).",
                              choices=("none", "correctness"))
    dynamic_sampling: bool = opt(False, "DAPO dynamic sampling: replace groups without correctness variance by "
                                 "groups for further prompts, in up to max_resample_rounds extra generation rounds.")
    max_resample_rounds: int = opt(3, "Extra generation rounds per step for --dynamic-sampling; still short, the "
                                   "batch is topped up with dropped groups.")
    per_device_train_batch_size: int = opt(16, "Completions per device batch (a multiple of num_generations).")
    gradient_accumulation_steps: int = opt(1, "Gradient accumulation steps.")
    learning_rate: float = opt(1e-3, "Peak learning rate (the seed's 1e-6 moves a tiny LoRA policy nowhere).")
    lr_scheduler_type: str = opt("cosine", "Learning-rate schedule.")
    beta: float = opt(0.0, "KL coefficient (0: no reference model).")
    epsilon: float = opt(0.2, "PPO clip epsilon.")
    max_steps: int = opt(50, "Optimizer steps (-1: num_train_epochs passes over the RL data, TRL's rule).")
    num_train_epochs: float = opt(1.0, "Passes over the RL data, each question drawn once a pass; counts only "
                                  "when max_steps is -1.")
    max_completion_length: int = opt(64, "Generation budget per completion.")
    logging_steps: int = opt(1, "Log metrics every N steps.")
    save_steps: int = opt(10, "Checkpoint every N steps.")
    completions_every: int = opt(5, "Log sampled completions as an MLflow table every N steps.")
    resume: bool = opt(False, "Resume from the last checkpoint in output_dir, in the same MLflow run.")
    output_dir: str = opt("outputs/grpo", "Folder for checkpoints and the final adapter.")

    def __post_init__(self):
        super().__post_init__()
        if self.max_steps == 0 or self.max_steps < -1:
            raise DataError(f"must be >= 1, or -1 for num_train_epochs passes, got {self.max_steps}", "config",
                            field="max_steps")
        if self.num_train_epochs <= 0:
            raise DataError(f"must be > 0, got {self.num_train_epochs}", "config", field="num_train_epochs")

    def questions_per_step(self, world_size: int = 1) -> StepDraw:
        """The distinct questions one optimizer step draws on `world_size` processes (`step_draw`)."""
        return step_draw(self.per_device_train_batch_size, self.num_generations, self.gradient_accumulation_steps,
                         self.trainer_args, world_size)


@dataclass(frozen=True)
class StepDraw:
    """What one GRPO optimizer step draws (`GRPOStageConfig.questions_per_step`): `questions` distinct questions,
    `why` the arithmetic that gives it, in the config's own names."""

    questions: int
    why: str

    def __str__(self) -> str:
        return f"{self.questions} ({self.why})"


def step_draw(per_device_train_batch_size: int, num_generations: int, gradient_accumulation_steps: int,
              trainer_args: dict, world_size: int = 1) -> StepDraw:
    """The distinct questions one GRPO optimizer step draws at this batch shape on `world_size` processes: the
    fewest an RL set (a filter band) must hold for GRPO to train at all.

    TRL 1.16's GRPOTrainer draws its prompts with RepeatSampler (trl/trainer/utils.py): each pass over the set is
    shuffled and cut into chunks of generation_batch_size / num_generations distinct prompts, and a last chunk
    of fewer is dropped. generation_batch_size = per_device_train_batch_size x processes x steps_per_generation,
    steps_per_generation defaulting to gradient_accumulation_steps (GRPOConfig.__post_init__; either may be set
    through trainer_args). One chunk feeds steps_per_generation x num_iterations micro-batches, so at least one
    optimizer step (transformers steps on a short accumulation at a pass's end); a set smaller than one chunk
    leaves the dataloader empty, and the trainer ends without a step. TRL's own refusals of these fields are
    made here too, before any model loads."""
    per_device, g, extra = per_device_train_batch_size, num_generations, trainer_args
    procs = f"{world_size} process{'es' if world_size != 1 else ''}"
    for name in ("generation_batch_size", "steps_per_generation"):
        value = extra.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise DataError(f"must be a positive integer, got {value!r}", "trainer_args", field=name)
    if extra.get("generation_batch_size") is not None and extra.get("steps_per_generation") is not None:
        raise SlmsqlError("trainer_args generation_batch_size and steps_per_generation: set one of them, not both "
                          "(TRL refuses both: each gives the other)")
    if (batch := extra.get("generation_batch_size")) is not None:
        if batch % (per_device * world_size):
            raise SlmsqlError(f"trainer_args generation_batch_size ({batch}) must be a multiple of "
                              f"per_device_train_batch_size ({per_device}) x {procs} (TRL's rule)")
        shape = f"generation_batch_size {batch} (trainer_args)"
    else:
        spg = extra.get("steps_per_generation")
        batch = per_device * world_size * (spg or gradient_accumulation_steps)
        shape = (f"per_device_train_batch_size {per_device} x " + (
            f"steps_per_generation {spg} (trainer_args)" if spg else
            f"gradient_accumulation_steps {gradient_accumulation_steps}") + f" x {procs}")
    if batch % g:
        raise SlmsqlError(f"num_generations ({g}) must divide the generation batch ({shape} = {batch} "
                          "completions): each batch holds whole groups")
    return StepDraw(batch // g, f"{shape} / num_generations {g}")


# The rl data check's default minimum band: what one step draws at GRPO's default batch shape, one process.
DEFAULT_DRAW = step_draw(GRPOStageConfig.per_device_train_batch_size, GRPOStageConfig.num_generations,
                         GRPOStageConfig.gradient_accumulation_steps, {})


@dataclass
class BandCheck:
    """The rl data check's minimum band size (filter, validate): the band must hold one GRPO optimizer step."""

    min_band: int = opt(DEFAULT_DRAW.questions, "Fewest questions the band may hold (rl data check): what one GRPO "
                        "optimizer step draws, per_device_train_batch_size x gradient_accumulation_steps x processes "
                        "/ num_generations (docs/stages/grpo.md); a smaller band trains nothing. The default is what "
                        "GRPO's default shape draws; the pipeline sets it from its GRPO step's shape.")

    def __post_init__(self):
        super().__post_init__()
        if self.min_band < 1:
            raise DataError(f"must be >= 1, got {self.min_band}", "config", field="min_band")


@dataclass
class FilterConfig(Model, Sampling, Workers, Engine, BandCheck, Common):
    """Sample the policy K times per question and bucket questions by pass rate."""

    key_metrics: ClassVar = ("band", "all_fail", "all_pass", "out_of_band", "errors")

    data: str = opt("outputs/toy/rl_source.jsonl", "Source questions in gold format.")
    db_root: str = opt("outputs/toy/databases", "Database folder.")
    k: int = opt(8, "Samples per question.")
    low: float = opt(0.2, "Band lower bound (exclusive).")
    high: float = opt(0.8, "Band upper bound (exclusive).")
    output_dir: str = opt("outputs/filter", "Folder for band.jsonl, passrates.jsonl, summary.json.")


@dataclass
class PublishConfig(Common):
    """Model card from the MLflow runs, pushed with the adapter to the Hub."""

    grpo_run: str = opt("", "MLflow run id of the GRPO run.", required=True)
    eval_runs: list[str] = opt([], "Comma-separated MLflow run ids of evaluation runs.")
    filter_run: str = opt("", "MLflow run id of the filter run.")
    sweep_run: str = opt("", "MLflow run id of the sweep whose cell --grpo-run is: the card then carries the "
                         "variants x seeds table and states the pooled verdict (--eval-runs default: the cell's).")
    study: str = opt("", "A study folder (studies/NAME) one of whose cell records names --grpo-run: the card then "
                     "states, from its report.json, each declared comparison's pooled and over-seeds verdicts, what "
                     "transferred and what did not, and the diagnosis per arm (--eval-runs default: the cell's).")
    repo_id: str = opt("", "Hub repo id OWNER/NAME.", required=True)
    base_repo: str = opt("", "Hub repo OWNER/NAME to push a local base model (a full fine-tune) to, with its own "
                         "card; the adapter's card and adapter_config.json then name it as the base.")
    base_run: str = opt("", "MLflow run id of the SFT run that wrote the local base (default: found from its path).")
    private: bool = opt(False, "Create the Hub repo private.")
    dry_run: bool = opt(False, "Push nothing to the Hub: write the folder that would be pushed (card, adapter), "
                        "log the text2sql model from it as a LoggedModel of its own (never the GRPO policy's, "
                        "which a later push fills) and register it under the alias 'dry-run' (never --alias). "
                        "The model is not loaded to check it, and no local base is copied into MLflow: one that "
                        "is a run's artifact is named by its runs:/ URI, another gets no model.")
    endpoint: str = opt("", "Hub endpoint (default: HF_ENDPOINT or huggingface.co).")
    license: str = opt("apache-2.0", "License in the card metadata.")
    registered_model: str = opt("", "MLflow registered model name (default: from repo id; 'none' to skip).")
    alias: str = opt("candidate", "Registry alias for the pushed version (a dry run's takes 'dry-run').")
    output_dir: str = opt("outputs/publish", "Folder for the card and the pushed files.")


@dataclass
class ValidateConfig(BandCheck, Common):
    """Great Expectations data checks on an RL band or an eval set."""

    key_metrics: ClassVar = ("n_failed",)

    kind: str = opt("rl", "Which suite: rl (filter output) or eval (an eval set).", choices=("rl", "eval"))
    data: str = opt("", "File to validate.", required=True)
    db_root: str = opt("", "Database folder.", required=True)
    summary: str = opt("", "The filter's summary.json (rl): bucket counts must add up.")
    eval_sets: list[str] = opt([], "Comma-separated eval files whose questions the RL set must not share.")
    low: float = opt(0.2, "Band lower bound (rl).")
    high: float = opt(0.8, "Band upper bound (rl).")
    output_dir: str = opt("outputs/validate", "Folder for the validation report.")


@dataclass
class PipelineConfig(Common):
    """The whole lifecycle on the toy world, each step an MLflow run under one parent."""

    key_metrics: ClassVar = ("eval-sft-dev/ex", "eval-grpo-dev/ex", "eval-grpo-dev/vs_baseline/p",
                             "eval-sft-dev_cross/ex", "eval-grpo-dev_cross/ex", "eval-grpo-dev_cross/vs_baseline/p")

    size: str = opt("small", "Toy world size.", choices=("small", "medium", "large"))
    model: str = opt("", "A pretrained chat model (Hub id or path) to run the lifecycle on: it is evaluated "
                     "zero-shot, then trained as the recipes say. Empty: the embedded tiny model, built here.")
    recipes: str = opt("", "Folder of stage recipes (<stage>.yaml, e.g. recipes/smollm2-135m): each applies to "
                       "every step of its stage, under the pipeline's own wiring and --overrides.")
    overrides: dict = opt({}, "Per-stage options, e.g. 'sft.max_steps=300 grpo.max_steps=4'.")
    reuse: bool = opt(True, "Reuse finished steps whose parameters and code version match.")
    repo_id: str = opt("slmsql/toy-grpo", "Hub repo id of the GRPO adapter.")
    base_repo: str = opt("slmsql/toy-sft", "Hub repo id of the SFT model (the adapter's local base, pushed too).")
    push: bool = opt(False, "Push base and adapter to the Hub (needs a token: HF_TOKEN or `hf auth login`); else "
                     "publish is a dry run. Either way the text2sql model is registered: alias candidate when pushed, "
                     "dry-run when not.")
    hub_endpoint: str = opt("", "Hub endpoint for the push (default: HF_ENDPOINT or huggingface.co).")
    output_dir: str = opt("outputs", "Folder for every step's outputs (outputs/<step>: the stages' own defaults).")


@dataclass
class SweepConfig(Common):
    """GRPO variants x training seeds from a starting policy (or several: a start axis) and its RL set: every cell
    trains and evaluates as child runs of one parent, which compares each variant (pooled over seeds) with its
    starting policy."""

    key_metrics: ClassVar = ("variants", "cells", "cells_reused")

    grid: str = opt("", "GRPO variants: space-separated axes FIELD=v1,v2 (every combination); ';' separates "
                    "groups, whose variants add up; 'defaults' is the GRPO config unchanged; a list field's "
                    "items are joined by '+'; 'trainer_args.KEY=v1,v2' varies one TRL field. "
                    "Empty: the GRPO config alone.")
    seeds: int = opt(3, "Training seeds per variant: --seed, --seed + 1, ...")
    model: list[str] = opt(["outputs/sft"], "Starting policy: a Hub id or a local path. Several (comma-separated) "
                           "are a start axis: every variant x seed is trained from each, and compared with its own "
                           "start, in one table (one Holm family).")
    base_adapter: list[str] = opt([], "Starting adapter on --model, one per --model; every cell trains it further.")
    data: list[str] = opt(["outputs/filter/band.jsonl"], "RL data: one file for every start, or one per --model "
                          "(each start's own filter band).")
    start_names: list[str] = opt([], "Names of the starts, one per --model (default: the last part of each path); "
                                 "with several starts the variants are labelled start=NAME ...")
    db_root: str = opt("outputs/toy/databases", "Database folder of the RL data (and of the eval sets, unless "
                       "--eval-db-roots).")
    eval_data: list[str] = opt(["outputs/toy/dev.jsonl", "outputs/toy/dev_cross.jsonl"],
                               "Comma-separated eval gold files.")
    eval_names: list[str] = opt([], "Comma-separated dataset names, one per eval file (default: the files' stems).")
    eval_db_roots: list[str] = opt([], "Comma-separated database folders, one per eval file (default: --db-root).")
    start_eval_data: list[str] = opt([], "An eval file of each start's own, one per --model (e.g. the RL band it "
                                     "trains on), beside the shared ones: each start's cells are scored on theirs, "
                                     "compared with that start on it, in the one Holm family.")
    start_eval_name: str = opt("start-own", "The dataset name of the --start-eval-data files (one name: one column "
                               "of the table).")
    baseline_runs: list[str] = opt([], "Comma-separated evaluate run ids of the starting policy, one per eval set "
                                   "(default: evaluate it here, once per eval set).")
    alpha: float = opt(0.05, "Significance level (family-wise, Holm over every variant x eval set).")
    grpo_recipe: str = opt("", "YAML recipe for every GRPO cell (the grid's values override it).")
    evaluate_recipe: str = opt("", "YAML recipe for every evaluation.")
    overrides: dict = opt({}, "Options for every cell, e.g. 'grpo.max_steps=20 evaluate.batch_size=32'.")
    reuse: bool = opt(True, "Reuse finished cells whose parameters and code version match.")
    output_dir: str = opt("outputs/sweep", "Folder for the cells' outputs and the report (report/, replaced "
                          "on every run).")

    def __post_init__(self):
        super().__post_init__()
        parse_grid(self.grid)  # a bad grid fails here, before any run starts
        if self.seeds < 1:
            raise DataError(f"must be at least 1, got {self.seeds}", "command line", field="seeds")


@dataclass
class PlanConfig(Common):
    """Size a study by power from a pilot: the minimum detectable difference of a design (seeds x questions,
    Holm family) and the questions each number of seeds needs for the target power at the pilot's effect."""

    pilot: str = opt("", "A pilot's report: a sweep's report/sweep.json (or runs:/<sweep run>/report/sweep.json) "
                     "or a study's report.json: every comparison's effect and variance components. Empty: give "
                     "--discordance.")
    eval_sets: list[str] = opt([], "Plan only the pilot's comparisons on these eval sets (default: all).")
    effect: float = opt(0.0, "The EX difference to power the study for (default: each comparison's pilot "
                        "difference).")
    discordance: float = opt(0.0, "Without --pilot: the share of questions where a one-seed pilot and its start "
                             "disagree (with --effect, the pilot's difference).")
    seed_sd: float = opt(-1.0, "Between-seed sd of the EX difference (a fraction), when the pilot cannot "
                         "give it (one seed; default -1: unknown, no plan over seeds).")
    seeds: int = opt(0, "Seeds of the design whose MDD is reported (default: the pilot's).")
    n: int = opt(0, "Questions of that design (default: each comparison's n).")
    family: int = opt(0, "Holm family size of the planned study (default: the pilot's comparisons).")
    alpha: float = opt(0.05, "Family-wise significance level.")
    power: float = opt(0.9, "Target power.")
    max_seeds: int = opt(8, "The largest number of seeds the sizing table tries.")
    max_n: int = opt(2000, "The most questions the sizing table allows (the band or eval set you can have).")
    output_dir: str = opt("outputs/plan", "Folder for plan.json and plan.md.")

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.alpha < 1 or not 0 < self.power < 1:
            raise DataError(f"alpha and power must lie strictly between 0 and 1, got {self.alpha}, {self.power}",
                            "command line", field="alpha" if not 0 < self.alpha < 1 else "power")
        for name in ("seeds", "n", "family", "max_seeds", "max_n"):
            if getattr(self, name) < 0:
                raise DataError(f"must be >= 0, got {getattr(self, name)}", "command line", field=name)


@dataclass
class StudyRunConfig:
    """Run what a study (studies/NAME/study.yaml) still misses: its start, then each cell without a record
    (GRPO, then evaluate on every eval set), writing one record per finished cell; then its report."""

    study: str = opt("", "The study folder (holding study.yaml).", required=True)
    shard: str = opt("", "K/N: run only the K-th of N shares of the declared cells (a cell is in share h mod N + "
                     "1, h a hash of its id: adding an arm or a seed moves no other cell), so N machines can split "
                     "a study; each runs the missing cells of its share and records K/N in them.")
    cells: list[str] = opt([], "Run only these cells (ids as in records/: ARM-seedS); 'start' makes the start "
                           "alone.")
    ray_address: str = opt("", "Send the cells to this Ray cluster (auto, HOST:PORT or ray://HOST:PORT) as tasks "
                           "with the CPUs and GPUs the study's budget gives a cell; this process writes the "
                           "records.")
    reuse: bool = opt(True, "Reuse finished MLflow steps whose parameters and code version match.")
    report: bool = opt(True, "Write the report from the records afterwards.")
    output_dir: str = opt("", "Folder for the steps' outputs (default outputs/studies/NAME).")

    def __post_init__(self):
        if self.shard and not re.fullmatch(r"[1-9][0-9]*/[1-9][0-9]*", self.shard) or (
                self.shard and int(self.shard.split("/")[0]) > int(self.shard.split("/")[1])):
            raise DataError(f"expected K/N with 1 <= K <= N, got {self.shard!r}", "command line", field="shard")
        if self.shard and self.cells:  # one would silently override the other
            raise DataError("give --cells or --shard, not both", "command line", field="cells")


@dataclass
class StudyReportConfig:
    """Build a study's report (report.md, report.json, forest.png in its folder) from its records alone."""

    study: str = opt("", "The study folder (holding study.yaml).", required=True)


STUDY_COMMANDS = {"run": StudyRunConfig, "report": StudyReportConfig}  # `slmsql study run|report FOLDER`


@dataclass
class SuiteBuildConfig(Common):
    """Build test suites (Zhong, Yu and Klein, EMNLP 2020) from Spider-format schemas and gold queries: for each
    db_id, generated databases distilled against each gold's near misses, written to OUT/<db_id>/*.sqlite with a
    manifest (docs/stages/suite.md)."""

    key_metrics: ClassVar = ("n_dbs", "coverage_mean", "n_empty")

    tables: str = opt("", "Spider/BIRD tables.json: the schemas.", required=True)
    data: str = opt("", "Questions with gold SQL: Spider's dev.json (a list with db_id, query, question) or the "
                    "project's JSONL.", required=True)
    db_ids: list[str] = opt([], "Comma-separated db_ids to build (default: every db_id the questions use).")
    cap: int = opt(20, "Databases kept per db_id at most (chosen from those the scan pooled).")
    candidates: int = opt(300, "Databases generated per db_id at most (fewer once every pair is told apart and every gold has rows).")
    sizes: list[int] = opt([5, 30], "Each candidate's tables hold 1 to B rows, B drawn per candidate from these.")
    timeout_s: float = opt(5.0, "Per-query execution deadline in seconds.")
    workers: int = opt(0, "Sandbox worker processes (0 = one per CPU core).")
    output_dir: str = opt("outputs/suites", "Folder for <db_id>/<db_id>*.sqlite, manifest.json and the "
                          "manifest's data check.")

    def __post_init__(self):
        super().__post_init__()
        for name in ("cap", "candidates"):
            if getattr(self, name) < 1:
                raise DataError(f"must be >= 1, got {getattr(self, name)}", "command line", field=name)
        if not self.sizes or min(self.sizes) < 1:
            raise DataError(f"each size must be >= 1, got {self.sizes}", "command line", field="sizes")


SUITE_COMMANDS = {"build": SuiteBuildConfig}  # `slmsql suite build`


STAGES = {"toy": ToyConfig, "tiny-model": TinyModelConfig, "sft": SFTStageConfig, "filter": FilterConfig,
          "grpo": GRPOStageConfig, "evaluate": EvaluateConfig, "publish": PublishConfig,
          "validate": ValidateConfig, "pipeline": PipelineConfig, "sweep": SweepConfig, "plan": PlanConfig}


def fields(cls):
    return dataclasses.fields(cls)


def default(f: dataclasses.Field):
    """A field's default value (lists and dicts come from their factory)."""
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def scalar(text: str):
    """A command-line value: true/false, null, an int, a float (1e-3 too), else the string itself. Not YAML's
    rules, under which `save_strategy=no` would arrive as False (and 1e-3 as a string)."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "null":
        return None
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    return text


def parse_trainer_args(value) -> dict:
    """'a=1 b=true c=x' (or a dict) -> {'a': 1, 'b': True, 'c': 'x'}; values parsed by `scalar`."""
    if isinstance(value, dict):
        return dict(value)
    out = {}
    for item in str(value or "").replace(",", " ").split():
        if "=" not in item:
            raise SlmsqlError(f"trainer_args: expected key=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = scalar(v)
    return out


def list_type(hint):
    """The element type of a list option (`list[str]` -> str), None for other hints."""
    return typing.get_args(hint)[0] if typing.get_origin(hint) is list else None


def coerce(cls, name: str, value, source="command line"):
    """One value for field `name` of `cls`, from a recipe, the command line or an MLflow param string."""
    f = {f.name: f for f in fields(cls)}[name]
    hint = typing.get_type_hints(cls)[name]
    try:
        if hint is dict:
            return parse_trainer_args(value)
        if elem := list_type(hint):
            items = value if isinstance(value, (list, tuple)) else str(value if value is not None else "").split(",")
            return [elem(str(x).strip()) for x in items if str(x).strip()]
        if hint is bool and isinstance(value, str):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes")
        if hint is int and isinstance(value, (str, float)) and float(value).is_integer():
            value = int(float(value))  # MLproject has no int type: "8.0" and "8" both mean 8
        value = hint(value) if value is not None else value
    except (TypeError, ValueError):
        raise DataError(f"expected {getattr(hint, '__name__', hint)}, got {value!r}", source, field=name) from None
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise DataError(f"must be one of {list(choices)}, got {value!r}", source, field=name)
    return value


def param_text(value) -> str:
    """A value as a command-line / MLproject parameter string, parsed back to the same value by `coerce`."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value))
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


# Fields that say where and how a stage ran, not what it computed: a trained model's params leave them out
# (lineage), and so does the command a card prints to reproduce a run (card.command)
RUN_ONLY = ("output_dir", "overwrite", "resume", "run_name", "experiment", "workers", "allow_prompt_change",
            "save_steps", "completions_every")


# GRPO fields a sweep sets itself, and the option that sets them
SWEEP_OWNED = {"seed": "--seeds", "model": "--model", "base_adapter": "--base-adapter", "data": "--data",
               "db_root": "--db-root", "experiment": "--experiment", "output_dir": "the sweep (per cell)",
               "run_name": "the sweep (per cell)", "overwrite": "the sweep", "resume": "the sweep"}


@dataclass(frozen=True)
class Variant:
    """One GRPO variant of a sweep: `settings` (field -> value; `trainer_args` a dict of TRL fields) on top of
    the sweep's GRPO config. `label` names it (`defaults` when it changes nothing)."""

    label: str
    settings: dict


def parse_grid(text: str, source: str = "--grid") -> list[Variant]:
    """`--grid` -> variants. Within a group, space-separated axes FIELD=v1,v2,... mean every combination of their
    values; groups separated by ';' add up (`runs_tier=0 format_tier=0; dynamic_sampling=true` is 2 variants,
    not 4). `defaults` is a group of one variant changing nothing. Values are coerced by the GRPO field's type;
    the items of a list field's value are joined by '+' (rewards=execution+format,execution);
    `trainer_args.KEY=v1,v2` varies one TRL field (values read as YAML scalars)."""
    import itertools

    cls = GRPOStageConfig
    names = {f.name for f in fields(cls)}
    variants: list[Variant] = []
    for group in (text or "").split(";") if (text or "").strip() else ["defaults"]:
        group = group.strip()
        if not group:
            raise DataError("empty variant group (two ';' in a row, or one at an end)", source)
        if group == "defaults":
            variants.append(Variant("defaults", {}))
            continue
        axes: dict[str, list] = {}
        for token in group.split():
            name, sep, values = token.partition("=")
            if not sep or not name:
                raise DataError(f"expected FIELD=v1,v2,..., got {token!r}", source)
            key = name.split(".", 1)
            if key[0] == "trainer_args" and len(key) == 2 and key[1]:
                coerced = [parse_trainer_args(f"{key[1]}={v}")[key[1]] for v in values.split(",") if v.strip()]
            elif name not in names:
                raise DataError(f"no such GRPO option; known: {sorted(names - set(SWEEP_OWNED))} (or "
                                "trainer_args.KEY)", source, field=name)
            elif name in SWEEP_OWNED:
                raise DataError(f"set by {SWEEP_OWNED[name]}, not by the grid", source, field=name)
            elif typing.get_type_hints(cls)[name] is dict:
                raise DataError("vary one TRL field at a time: trainer_args.KEY=v1,v2", source, field=name)
            else:
                raw = [v.strip() for v in values.split(",") if v.strip()]
                multi = list_type(typing.get_type_hints(cls)[name])
                coerced = [coerce(cls, name, v.split("+") if multi else v, source) for v in raw]
            if not coerced:
                raise DataError("no values", source, field=name)
            if name in axes:
                raise DataError("axis given twice in one group", source, field=name)
            texts = [param_text(v) for v in coerced]
            if len(set(texts)) != len(texts):
                raise DataError(f"a value is given twice: {values!r}", source, field=name)
            axes[name] = coerced
        for combo in itertools.product(*axes.values()):
            settings, label = {}, []
            for name, value in zip(axes, combo):
                if name.startswith("trainer_args."):
                    settings.setdefault("trainer_args", {})[name.split(".", 1)[1]] = value
                else:
                    settings[name] = value
                shown = "+".join(map(str, value)) if isinstance(value, list) else param_text(value)
                label.append(f"{name}={shown}")
            variants.append(Variant(" ".join(label), settings))
    labels = [v.label for v in variants]
    if dup := sorted({x for x in labels if labels.count(x) > 1}):
        raise DataError(f"variant(s) {dup} given more than once", source)
    return variants


class RecipeLoader(yaml.SafeLoader):
    """YAML with 1.2's scalars where 1.1 (PyYAML's) surprises: only true/false are booleans (under 1.1
    `trainer_args: {save_strategy: no}` reached TRL as False; `yes`/`no` still mean true/false for a bool field,
    by `coerce`), and `1e-5` is a float, not the string '1e-5'."""


RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))
RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+$"),
                                   list("-+0123456789"))


def recipe_values(cls, recipe) -> dict:
    """The fields a YAML recipe sets, coerced to `cls`'s types; errors name the file, line and field."""
    names = {f.name for f in fields(cls)}
    path = Path(recipe)
    if not path.is_file():
        raise DataError("recipe not found", path)
    try:
        doc = yaml.load(path.read_text(), Loader=RecipeLoader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise DataError(f"malformed YAML: {e}", path, mark.line + 1 if mark else None) from None
    if not isinstance(doc, dict):
        raise DataError("a recipe is a mapping of field: value", path)
    values = {}
    for k, v in doc.items():
        if k not in names:
            raise DataError(f"unknown field for {cls.__name__}; known: {sorted(names)}", path, field=k)
        values[k] = coerce(cls, k, v, path)
    return values


def recipe_paths(recipe: str | None) -> list[str]:
    """`--recipe A.yaml,B.yaml`: recipes stacked in order, e.g. a model's stage recipe and then a reward set
    (recipes/rewards/) that is no model's fact."""
    return [p.strip() for p in (recipe or "").split(",") if p.strip()]


def load(cls, recipe: str | None = None, cli: dict | None = None, require: bool = True,
         defaults_yield: bool = False):
    """Resolve a stage config: defaults < recipe YAML < command-line values (see module docstring).
    `defaults_yield`: command-line values equal to the default do not override the recipe (mlflow run)."""
    values: dict = {}
    for path in recipe_paths(recipe):  # stacked recipes: a later one's keys win, trainer_args merge
        for k, v in recipe_values(cls, path).items():
            values[k] = {**values.get(k, {}), **v} if isinstance(v, dict) else v
    defaults = cls()
    for k, v in (cli or {}).items():
        if v is None:
            continue
        v = coerce(cls, k, v, "command line")
        if isinstance(v, dict):
            values[k] = {**values.get(k, {}), **v}
        elif k not in values or not defaults_yield or v != getattr(defaults, k):
            values[k] = v
    cfg = cls(**values)
    missing = [f.name for f in fields(cls) if f.metadata.get("required") and not getattr(cfg, f.name)]
    if missing and require:
        raise SlmsqlError(f"missing required option(s): {', '.join('--' + m.replace('_', '-') for m in missing)}")
    return cfg


def to_params(cfg) -> dict:
    """Flat str -> str params for MLflow (trainer_args flattened as trainer_args.<key>). Empty options are left
    out, and so is an option that only applies with another one (`only_with`) when that one is empty."""
    out = {}
    for f in fields(cfg):
        k, v = f.name, getattr(cfg, f.name)
        if v in ("", [], {}) or ("only_with" in f.metadata and not getattr(cfg, f.metadata["only_with"])):
            continue
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": json.dumps(vv) for kk, vv in v.items()})
        else:  # booleans as the command line and MLproject write them (true/false), as every step logs them
            out[k] = param_text(v)
    return out
