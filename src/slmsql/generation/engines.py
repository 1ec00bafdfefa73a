"""Where filter's and evaluate's work runs: questions -> completions -> scored outcomes, one row per question.

Two engines, one contract, the same rows:
- `local`: this process generates chunk by chunk and one `SandboxPool` scores (one machine).
- `ray`: a Ray Data pipeline, `from_items(questions) -> map_batches(_Generate actors: each loads the model
  once, CPU or GPU, with transformers or as its own vLLM engine) -> map_batches(_Score actors: each holds its
  own SandboxPool, the sandbox's limits unchanged)`, streamed back to the driver. Ray restarts a dead actor
  and retries its batch (`max_restarts` / `max_task_retries`, Ray Data's defaults for actor pools:
  unlimited), and the driver accepts each question exactly once, so a retried batch neither loses nor
  double-counts one.

Rows do not depend on the engine or on how the questions are split: sampled completions are seeded by
(seed, question id, sample index) (`seeds.sample_seed`), scoring is deterministic, and each row holds
one whole question (its K samples are aggregated where they are scored). The driver writes rows as they
arrive (`on_rows`), which is what lets a killed driver resume from the questions already finished.

`Work` says what runs per question: the filter's K samples -> passrates row, or evaluate's greedy completion
(or a given prediction) -> results row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from slmsql.errors import SlmsqlError
from slmsql.inputs.data import Example, dumps, example_from_json

# (example, payload, row): payload is what scoring judged (filter: the K completions; evaluate: the prediction)
Item = tuple[Example, object, dict]


@dataclass(frozen=True)
class Work:
    stage: str  # "filter" or "evaluate"
    cfg: object  # its FilterConfig / EvaluateConfig
    policy: object = None  # the stage's resolved Policy (policy/resolve.py); None: resolved from cfg when loading

    def load_policy(self, examples: list[Example] = (), longest: int | None = None):
        """(model, tokenizer); with --backend vllm (vllm_engine.Engine, tokenizer), sized for the longest prompt
        of `examples` (or for `longest` tokens, where the caller measured them)."""
        from slmsql.policy.resolve import Policy

        policy = self.policy or Policy.resolve(self.cfg, self.cfg.adapter or None)
        if self.cfg.backend != "vllm":
            return policy.load()
        from slmsql.generation import vllm_engine

        tokenizer = policy.tokenizer
        if longest is None:
            longest = self.longest_prompt(examples, tokenizer)
        share = self.cfg.ray_gpus_per_generator if self.cfg.engine == "ray" else 0.0
        return vllm_engine.load(self.cfg, longest, tokenizer, gpu_memory_utilization=gpu_memory_utilization(share))

    @staticmethod
    def policy_dtype(policy) -> str:
        """The precision a loaded policy generates in ('' when it does not say): a transformers model's dtype,
        or the one its vLLM engine was built with."""
        return str(getattr(policy[0], "dtype", "")).removeprefix("torch.")

    def longest_prompt(self, examples: list[Example], tokenizer) -> int:
        """Tokens in the longest prompt generate() will build for `examples` (0: none)."""
        from slmsql.generation import sampling as generation
        from slmsql.inputs.data import db_path

        have_db = [e for e in examples if db_path(self.cfg.db_root, e.db_id).is_file()]
        if not have_db:
            return 0
        ids = tokenizer(generation.prompts_for(self.cfg, have_db, tokenizer), add_special_tokens=False)["input_ids"]
        return max(len(x) for x in ids)

    def sampling(self) -> dict | None:
        """The filter's sampling settings (configs.Sampling); None: evaluate's greedy decoding."""
        return self.cfg.sampling() if self.stage == "filter" else None

    def generate(self, examples: list[Example], policy, progress: bool = True, known: dict | None = None,
                 on_answers: Callable | None = None) -> dict[str, object]:
        """id -> payload. The filter skips questions whose database is missing (scored as errors). Evaluate
        resumes: `known` answers are not generated again, `on_answers` gets each batch's (generation.predict)."""
        from slmsql.generation import sampling as generation
        from slmsql.inputs.data import db_path

        cfg = self.cfg
        if self.stage == "evaluate":
            return generation.predict(cfg, examples, policy, progress=progress, known=known, on_answers=on_answers)
        have_db = [e for e in examples if db_path(cfg.db_root, e.db_id).is_file()]
        if not have_db:
            return {}
        return dict(zip([e.id for e in have_db], generation.complete(
            cfg, have_db, policy, k=cfg.k, sampling=self.sampling(), progress=progress)))

    def score(self, examples: list[Example], payloads: dict[str, object], pool) -> list[dict]:
        cfg = self.cfg
        if self.stage == "evaluate":
            from slmsql.sql.scoring import score_predictions

            return score_predictions(examples, payloads, cfg.db_root, pool, cfg.match)
        from slmsql.sql.passrates import question_rows

        return question_rows(examples, payloads, db_root=cfg.db_root, k=cfg.k, low=cfg.low, high=cfg.high,
                             match=cfg.match, executor=pool)

    def limits(self):
        from slmsql.sql.sandbox import Limits

        return Limits(timeout_s=self.cfg.timeout_s)


VLLM_GPU_MEMORY = 0.9  # vLLM's default gpu_memory_utilization: the share of a whole GPU an engine claims


def gpu_memory_utilization(gpus: float) -> float | None:
    """vLLM's gpu_memory_utilization for an engine given `gpus` of a GPU (a Ray actor's num_gpus): a fraction
    claims that fraction of vLLM's default, so the engines sharing a GPU fit beside each other (two at 0.5:
    0.45 each); None (vLLM's default) for a whole GPU or more, and where none is reserved (local, CPU)."""
    return round(VLLM_GPU_MEMORY * gpus, 4) if 0 < gpus < 1 else None


def run(work: Work, examples: list[Example], on_rows: Callable[[list[Item]], None], *,
        payloads: dict[str, object] | None = None, chunk: int | None = None, policy=None,
        known: dict[str, object] | None = None, on_answers: Callable[[dict], None] | None = None) -> None:
    """Score every example exactly once; `on_rows` gets each finished batch (in any order on Ray).
    `payloads` given (evaluate --predictions): nothing is generated. Local engine: `chunk` questions per
    round (default: all at once), `policy` the model `check` loaded (else loaded here). The precision the
    policy generated in, on either backend and engine, is the active MLflow run's slmsql.dtype tag.
    Evaluate's resume: `on_answers` gets answers by id as soon as they exist (a generation batch, a Ray shard),
    `known` gives back those of a killed run, scored again but not generated again."""
    seen: set[str] = set()
    dtypes: set[str] = set()

    def accept(items: list[Item]) -> None:
        # The exactly-once guard: whatever an engine retried, a question reaches the output once.
        for e, _, _ in items:
            if e.id in seen:
                raise SlmsqlError(f"engine {work.cfg.engine} returned question {e.id!r} twice")
            seen.add(e.id)
        on_rows(items)

    if not examples:
        return
    if work.cfg.engine == "ray":
        if known:  # Ray batches as it schedules: what a killed run answered is scored here, the rest runs there
            _run_local(work, [e for e in examples if e.id in known], accept, known, len(examples), None, dtypes)
        def report(items: list[Item]) -> None:
            if on_answers:
                on_answers({e.id: p for e, p, _ in items})
            accept(items)

        if todo := [e for e in examples if e.id not in (known or {})]:
            _run_ray(work, todo, report, payloads, dtypes)
    else:
        _run_local(work, examples, accept, payloads, chunk or len(examples), policy, dtypes, known, on_answers)
    if dtypes - {""}:
        from slmsql.policy.models import tag_dtype

        tag_dtype(", ".join(sorted(dtypes - {""})))
    if len(seen) != len(examples):
        lost = [e.id for e in examples if e.id not in seen]
        raise SlmsqlError(f"engine {work.cfg.engine} returned no row for {len(lost)} questions, e.g. {lost[:3]}")


def run_params(work: Work) -> dict:
    """Params beside the config's: the vLLM version generation ran with."""
    from slmsql.generation import vllm_engine

    return vllm_engine.run_params(work.cfg)


def check_settings(work: Work, generating: bool) -> None:
    """The engine's checks that read no weights (a stage makes them first, beside resolving its Policy, which checks
    the adapter against the base for both backends): what vLLM cannot honour, vLLM or Ray missing."""
    if generating and work.cfg.backend == "vllm":
        from slmsql.generation import vllm_engine

        vllm_engine.check(work.cfg, work.sampling())
    if work.cfg.engine == "ray":
        _import_ray()


def check(work: Work, generating: bool, examples: list[Example] = ()):
    """Fail before any output folder or MLflow run exists: the local engine loads the model (returned, to be
    reused; with --backend vllm, after vllm_engine.check, the engine sized for `examples`), the Ray engine
    checks that Ray is installed (the stage's Policy has loaded the model's config and tokenizer)."""
    check_settings(work, generating)
    if work.cfg.engine != "ray":
        return work.load_policy(examples) if generating else None
    return None


# ---- local -------------------------------------------------------------------------------------------------

def _run_local(work, examples, on_rows, payloads, chunk, policy, dtypes, known=None, on_answers=None):
    from slmsql.sql.sandbox import SandboxPool

    if payloads is None and policy is None:
        policy = work.load_policy(examples)
    if policy is not None:
        dtypes.add(work.policy_dtype(policy))
    with SandboxPool(work.cfg.workers or None, work.limits()) as pool:
        for start in range(0, len(examples), chunk):
            part = examples[start:start + chunk]
            got = ({e.id: payloads.get(e.id) for e in part} if payloads is not None
                   else work.generate(part, policy, known=known, on_answers=on_answers))
            rows = work.score(part, got, pool)
            on_rows([(e, got.get(e.id), r) for e, r in zip(part, rows)])


# ---- Ray ---------------------------------------------------------------------------------------------------

def _import_ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        raise SlmsqlError("--engine ray needs Ray: pip install -e '.[ray]'") from e
    return ray


def connect(address: str = "") -> bool:
    """Join the Ray cluster at `address` ('auto', HOST:PORT, ray://HOST:PORT), or start a local one in this
    process when it is empty. A Ray this process already joined is reused. True when this call started it."""
    ray = _import_ray()
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address)
    else:
        ray.init(include_dashboard=False)
    return True


class _Generate:
    """A Ray Data actor: loads the policy once, then turns batches of questions into payloads. With --backend
    vllm each actor builds its own engine in its own process (vllm_engine.ENV: in-process, no engine
    subprocess), sized for the longest prompt of the whole run (`longest`, measured by the driver)."""

    def __init__(self, work: Work, longest: int | None = None):
        self.work = work
        self.policy = work.load_policy(longest=longest)

    def __call__(self, batch: dict) -> dict:
        examples = [example_from_json(x) for x in batch["example"]]
        got = self.work.generate(examples, self.policy, progress=False)
        return {**batch, "payload": [dumps(got.get(e.id)) if e.id in got else "" for e in examples],
                "dtype": [self.work.policy_dtype(self.policy)] * len(examples)}


class _Score:
    """A Ray Data actor holding its own sandbox pool (limits unchanged); returns one row per question.
    The pool's workers end with the actor however it ends: each watches its pool's owner
    (`sandbox._exit_with_owner`)."""

    def __init__(self, work: Work, workers: int):
        from slmsql.sql.sandbox import SandboxPool

        self.work = work
        self.pool = SandboxPool(workers, work.limits())

    def __call__(self, batch: dict) -> dict:
        import json

        examples = [example_from_json(x) for x in batch["example"]]
        payloads = {e.id: json.loads(p) for e, p in zip(examples, batch["payload"]) if p}
        rows = self.work.score(examples, payloads, self.pool)
        return {"idx": batch["idx"], "payload": batch["payload"], "row": [dumps(r) for r in rows],
                "dtype": batch["dtype"] if "dtype" in batch else [""] * len(examples)}


def _run_ray(work: Work, examples, on_rows, payloads, dtypes):
    import json

    import ray.data
    from ray.data import ActorPoolStrategy

    cfg = work.cfg
    started = connect(cfg.ray_address)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False  # the driver's own bar counts questions
        # Rows carry JSON text (data.dumps: lone surrogates escaped), which Arrow stores as it is.
        items = [{"idx": i, "example": dumps(e.to_json()),
                  "payload": "" if payloads is None or payloads.get(e.id) is None else dumps(payloads[e.id])}
                 for i, e in enumerate(examples)]
        from slmsql.sql.passrates import CHUNK

        ds = ray.data.from_items(items, override_num_blocks=max(1, math.ceil(len(items) / CHUNK)))
        if payloads is None:
            longest = None
            if cfg.backend == "vllm":  # the engine's context is sized before any actor sees a question
                from slmsql.policy.models import load_tokenizer

                tokenizer = work.policy.tokenizer if work.policy else load_tokenizer(cfg.model)
                longest = work.longest_prompt(examples, tokenizer)
            ds = ds.map_batches(
                _Generate, fn_constructor_kwargs={"work": work, "longest": longest}, batch_size=cfg.batch_size,
                compute=ActorPoolStrategy(size=cfg.ray_generators), num_cpus=cfg.ray_cpus_per_generator,
                num_gpus=cfg.ray_gpus_per_generator or None)
        sandbox_workers = cfg.workers or max(1, round(cfg.ray_cpus_per_scorer))
        ds = ds.map_batches(
            _Score, fn_constructor_kwargs={"work": work, "workers": sandbox_workers},
            batch_size=cfg.ray_score_batch, compute=ActorPoolStrategy(size=cfg.ray_scorers),
            num_cpus=cfg.ray_cpus_per_scorer)
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            dtypes.update(str(d) for d in batch["dtype"])
            on_rows([(examples[int(i)], json.loads(p) if p else None, json.loads(r))
                     for i, p, r in zip(batch["idx"], batch["payload"], batch["row"])])
    finally:
        if started:
            import ray

            ray.shutdown()

