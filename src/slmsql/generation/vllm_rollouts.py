"""GRPO's rollouts from slmsql's vLLM engine (`slmsql grpo --backend vllm`), the policy of every step as a LoRA.

TRL 1.16's `GRPOTrainer(rollout_func=...)` (experimental) hands each generation batch's prompts to `Rollouts`,
which samples them from one vLLM engine (vllm_engine.load) and returns prompt ids, completion ids and the
engine's log-probs of the sampled tokens. Before the first rollout of every optimizer step TRL calls
`sync_weights()` (as for its own vLLM modes): the trainer's LoRA is saved (PEFT format, a few MB, 0.05-0.1 s for
SmolLM2-135M at r = 16) and served under a new `LoRARequest` with a new int id. vLLM caches adapters by id: the
same id would keep serving the old weights. The engine's base weights are never touched: vLLM's CPU build packs
them for its own kernels and drops their loaders (vllm_engine.COLOCATE_ON_CPU). Writing the tensors straight
into vLLM's LoRA slots would save the file round trip, under 1% of a step, by reaching into vLLM's internals.

The same work as the transformers path: prompts tokenized by the trainer itself (`_tokenize_prompts`: TRL's
chat template); the trainer's temperature, top_p, top_k, min_p, repetition_penalty, completion budget, stop
tokens (`eos_token_ids`) and `generation_kwargs`. A prompt's K samples are one request (n = K) seeded
`generation.sample_seed(seed, key, 0)`, key = (step, the prompt's tokens, its occurrence in the step): the
same question at the same step draws the same samples, resumed or not, whatever shares its batch.

The log-prob gap: TRL recomputes the policy's log-probs of the sampled tokens, logs
`sampling/sampling_logp_difference/{mean,max}` and weights the loss by its importance-sampling correction
(`vllm_importance_sampling_*`, on by default) only when `use_vllm` is set, and it builds its own engine when
`args.use_vllm` is set. So the trainer (slmsql.training.vllm_trainer) sets `use_vllm` after TRL's init: TRL
measures these rollouts as it measures its own. The checks TRL's init makes on `use_vllm` are skipped that way, so
`trl_vllm_checks` makes them before any model loads (tests/test_vllm_grpo.py reads TRL's init for any it would
miss). The engine returns `processed_logprobs` (after temperature, as TRL's policy log-probs are).

A LoRA that sits on merged adapters (`--adapter-mode stack`, or a continued adapter that was itself stacked) is
served on that merge, saved once into the work folder.
"""

from __future__ import annotations

import contextlib
import gc
import shutil
from collections import Counter
from pathlib import Path

from slmsql.errors import SlmsqlError

FULL_WEIGHTS = (
    "--backend vllm serves the policy of each step to its engine as a LoRA adapter: train one (--use-lora true, or "
    "--base-adapter in continue mode). A full-weight policy would have to be loaded into the engine's weights every "
    "step, which vLLM's CPU build cannot take (it packs them for its own kernels), or the engine rebuilt from a saved "
    "model every step (tens of seconds each); on a GPU use TRL's own vLLM modes (--trainer-args use_vllm=true)")


def trains_lora(cfg) -> bool:
    return cfg.use_lora or (bool(cfg.base_adapter) and cfg.adapter_mode == "continue")


def check(cfg, world_size: int) -> None:
    """`--backend vllm`'s refusals, before any model loads."""
    if cfg.backend != "vllm":
        return
    from slmsql.generation import vllm_engine

    if not trains_lora(cfg):
        raise SlmsqlError(FULL_WEIGHTS)
    if world_size > 1:
        raise SlmsqlError(f"--backend vllm runs in one process (one engine beside one trainer); this launch has "
                          f"{world_size}: launch one process, or use TRL's vLLM server mode (--trainer-args "
                          "use_vllm=true vllm_mode=server) on GPUs")
    if cfg.trainer_args.get("use_vllm"):
        raise SlmsqlError("--backend vllm and --trainer-args use_vllm=true both generate with vLLM: choose one")
    trl_vllm_checks(cfg.trainer_args)
    vllm_engine.check(cfg, cfg.sampling())


def generation_batch(args) -> tuple[int, int]:
    """(prompts, samples per prompt) of one TRL generation batch on this process (a resolved GRPOConfig):
    per_device_train_batch_size x steps_per_generation completions in groups of num_generations."""
    k = args.num_generations
    return args.per_device_train_batch_size * args.steps_per_generation // k, k


def sleeps(cfg) -> bool:
    """Whether the engine sleeps between rollouts on a GPU (vLLM's sleep mode: its memory free for the update
    step, at the cost of moving the weights back): `--trainer-args vllm_enable_sleep_mode=true`, TRL's own switch
    for its engines, off by default as in TRL (never yet run on a GPU here: bench/README.md's GPU checks). A CPU
    engine has no sleep mode."""
    return bool(cfg.trainer_args.get("vllm_enable_sleep_mode", False))


def memory_estimate(cfg, args, longest: int, *, gpu: int, dtype: str):
    """vllm_memory.Estimate of this run's engine (`args`: the resolved GRPOConfig; `longest`: the longest
    prompt in tokens) on a GPU of `gpu` bytes, in `dtype`: the model's facts from its config.json."""
    import torch
    from transformers import AutoConfig

    from slmsql.generation import vllm_engine, vllm_memory

    prompts, k = generation_batch(args)
    need = max(longest, 1) + args.max_completion_length
    sizes = vllm_engine.sizing(prompts=prompts, samples=k, longest=longest, need=need, chunked=True)
    return vllm_memory.estimate(
        AutoConfig.from_pretrained(cfg.model), dtype_bytes=getattr(torch, dtype).itemsize,
        lora_rank=vllm_engine._lora_rank(lora_rank(cfg)), sizes=sizes, prompts=prompts, samples=k,
        longest=longest, new_tokens=args.max_completion_length, gpu=gpu,
        utilization=args.vllm_gpu_memory_utilization)


def lora_rank(cfg) -> int:
    """The rank of the LoRA the engine serves: the new one's, or the continued adapter's."""
    if cfg.base_adapter and cfg.adapter_mode == "continue":
        from peft import PeftConfig

        from slmsql.policy.models import adapter_folder

        return PeftConfig.from_pretrained(str(adapter_folder(cfg.base_adapter))).r
    return cfg.lora_r


def preflight(cfg, args, longest: int) -> str:
    """--backend vllm: the engine's GPU memory estimated before any model loads and refused with the numbers when
    it exceeds its share; returns what was found, to log. On a CPU the check is skipped (vLLM's CPU engine
    takes VLLM_CPU_KVCACHE_SPACE GiB of RAM for its cache and profiles nothing), and so is sleeping."""
    if cfg.backend != "vllm":
        return ""
    import torch

    if not torch.cuda.is_available():
        return ("vLLM rollout engine: no GPU, so its memory preflight and its sleep between rollouts are skipped "
                "(the CPU engine's cache is VLLM_CPU_KVCACHE_SPACE GiB of RAM)")
    from slmsql.policy.models import dtype_name

    est = memory_estimate(cfg, args, longest, gpu=torch.cuda.get_device_properties(0).total_memory,
                          dtype=dtype_name(cfg.dtype, "cuda"))
    if not est.fits():
        raise SlmsqlError(f"--backend vllm: the rollout engine does not fit its share of the GPU: {est.describe()}. "
                          "Raise --trainer-args vllm_gpu_memory_utilization=..., or shrink a generation batch "
                          "(per_device_train_batch_size, steps_per_generation), max_completion_length or the "
                          "prompts (docs/vllm.md)")
    return f"vLLM rollout engine, estimated: {est.describe()}; sleeps between rollouts: {sleeps(cfg)}"
VESPO = ("--backend vllm with --trainer-args loss_type=vespo: VESPO needs TRL's token-level importance sampling "
         "(vllm_importance_sampling_mode=token_truncate or token_mask; TRL's default is {mode}) or the correction off "
         "(vllm_importance_sampling_correction=false); TRL's GRPOTrainer refuses the rest")


def trl_vllm_checks(trainer_args: dict) -> None:
    """The refusals GRPOTrainer.__init__ makes when `use_vllm` is set (TRL 1.16: VESPO's importance-sampling mode),
    which this trainer skips by setting `use_vllm` after that init (module docstring)."""
    import dataclasses

    from trl import GRPOConfig

    value = {f.name: f.default for f in dataclasses.fields(GRPOConfig)} | trainer_args
    if (value["loss_type"] == "vespo" and value["vllm_importance_sampling_correction"]
            and value["vllm_importance_sampling_mode"] not in ("token_truncate", "token_mask")):
        raise SlmsqlError(VESPO.format(mode=value["vllm_importance_sampling_mode"]))


def lora_digest(model) -> str:
    """sha256 of the model's LoRA tensors as they are now (names and values): which policy an adapter is. A few MB
    at the recipes' ranks, hashed in milliseconds on a CPU, once at each sync and once at each rollout."""
    import hashlib

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if "lora_" in name:
            h.update(name.encode())
            h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def engine_base(cfg, work: Path, merged=None, tokenizer=None) -> str:
    """The model the engine serves the LoRA on: cfg.model, or the adapters beneath the LoRA merged into it and saved
    under `work` (`merged`, `tokenizer`: that merge, where the stage has it loaded already)."""
    from slmsql.policy.models import load_model, stacked_on

    beneath = None
    if cfg.base_adapter:
        beneath = cfg.base_adapter if cfg.adapter_mode == "stack" else stacked_on(cfg.base_adapter)
    if beneath is None:
        return cfg.model
    if merged is None:
        merged, tokenizer = load_model(cfg.model, str(beneath), merge_adapter=True, dtype=cfg.dtype)
    folder = Path(work) / "vllm-base"
    merged.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@contextlib.contextmanager
def global_rngs_kept():
    """Python's, NumPy's and torch's global generators (CPU and every GPU) as they were before the block: vLLM seeds
    them all with its `seed` when its engine starts (vllm.utils.torch_utils.set_random_seed), which in this process
    would overwrite the trainer's state, e.g. the one `--resume` has just restored from the checkpoint. The rollouts
    do not need it: every request carries its own seed."""
    import random

    import numpy as np
    import torch

    state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.random.set_rng_state(state[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class Rollouts:
    """TRL's `rollout_func` and, bound to the trainer as its `vllm_generation`, the weight sync TRL calls."""

    def __init__(self, cfg, base: str, longest: int, tokenizer, work: Path):
        self.cfg, self.base, self.longest, self.tokenizer = cfg, base, longest, tokenizer
        self.folder = Path(work) / "vllm-lora"
        self.engine = self.lora = self.trainer = None
        self.lora_id, self.step, self.seen = 0, None, Counter()
        self.served: dict[int, tuple[int, str]] = {}  # LoRARequest id -> (trainer step, lora_digest) it carried
        self.sleeps = False  # between rollouts the engine sleeps (GPU only: `sleeps`)

    def bind(self, trainer):
        self.trainer = trainer
        return self

    def sync_weights(self) -> None:
        """The trainer's LoRA as it is now, saved and served under a new LoRARequest id."""
        from vllm.lora.request import LoRARequest

        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        self.lora_id += 1
        folder = self.folder / str(self.lora_id)
        model.save_pretrained(str(folder), selected_adapters=["default"])
        self.served = {self.lora_id: (self.trainer.state.global_step, lora_digest(model))}
        if self.engine is None:
            self.engine = self._start(model.peft_config["default"].r)
        old, self.lora = self.lora, LoRARequest(f"policy-{self.lora_id}", self.lora_id, str(folder))
        if old is not None:  # vLLM read it when it served it; it is never asked for again
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def _start(self, rank: int):
        import types

        import torch

        from slmsql.generation import vllm_engine

        t = self.trainer
        prompts, k = generation_batch(t.args)
        # vllm_engine.load's view of this run: the engine's base, the completion budget, one generation batch (its
        # prompts, each one request of K samples: vllm_engine.sizing), the seed and precision
        view = types.SimpleNamespace(model=self.base, adapter="", max_new_tokens=t.max_completion_length,
                                     batch_size=prompts, k=k, seed=self.cfg.seed, dtype=self.cfg.dtype)
        extra = dict(enable_lora=True, max_lora_rank=vllm_engine._lora_rank(rank), logprobs_mode="processed_logprobs")
        if torch.cuda.is_available():  # the trainer shares the GPU: TRL's own share for a colocated engine
            extra["gpu_memory_utilization"] = t.args.vllm_gpu_memory_utilization
            extra["enable_sleep_mode"] = self.sleeps = sleeps(self.cfg)
        with global_rngs_kept():
            engine, _ = vllm_engine.load(view, self.longest, self.tokenizer, **extra)
        return engine

    def __call__(self, prompts: list, trainer) -> dict:
        from slmsql.generation import vllm_engine
        from slmsql.runtime.seeds import sample_seed

        t = trainer
        if t.state.global_step != self.step:
            self.step, self.seen = t.state.global_step, Counter()
        ids, _, _ = t._tokenize_prompts(prompts)
        k = t.num_generations if t.model.training else t.num_generations_eval
        # TRL's sampler puts a prompt's K copies next to each other: one request of n = K per group
        groups = [list(ids[i]) for i in range(0, len(ids), k)]
        if any(list(ids[i]) != groups[i // k] for i in range(len(ids))):
            raise SlmsqlError(f"rollouts: the batch's {len(ids)} prompts are not groups of {k} copies")
        params = []
        for group in groups:
            self.seen[tuple(group)] += 1
            key = f"{self.step}\x00{self.seen[tuple(group)]}\x00{group}"
            params.append(vllm_engine.sampling_params(
                k=k, temperature=t.temperature, top_p=t.top_p, top_k=t.top_k, min_p=t.min_p,
                repetition_penalty=t.repetition_penalty, max_new_tokens=t.max_completion_length,
                stop_ids=t.eos_token_ids, seed=sample_seed(self.cfg.seed, key, 0), logprobs=0,
                **(t.args.generation_kwargs or {})))
        if self.sleeps:
            self.engine.llm.wake_up()
        done = self.engine.llm.generate([{"prompt_token_ids": g} for g in groups], params, lora_request=self.lora,
                                        use_tqdm=False)
        if self.sleeps:  # level 1: weights to CPU memory, KV cache dropped, the GPU free for the update
            self.engine.llm.sleep(level=1)
        step = self.policy_step({r.lora_request.lora_int_id if r.lora_request else None for r in done}, t)
        t._metrics["train" if t.model.training else "eval"]["rollout/policy_step"].append(step)
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for group, request in zip(groups, done):  # returned in input order
            for c in request.outputs:
                out["prompt_ids"].append(group)
                out["completion_ids"].append(list(c.token_ids))
                out["logprobs"].append([lp[token].logprob for token, lp in zip(c.token_ids, c.logprobs)])
        return out

    def policy_step(self, used: set, trainer) -> int:
        """The trainer step whose adapter the engine sampled with, read from the LoRARequest that vLLM's outputs name;
        refused unless that adapter is the policy as it is now (its step and its weights' digest): a stale adapter
        would train on another policy's samples, which no log-prob gap shows at small learning rates."""
        (lora_id,) = used if len(used) == 1 else (None,)
        if lora_id not in self.served:
            raise SlmsqlError(f"rollouts: the engine sampled with LoRA {sorted(map(str, used))}, not the one this "
                              f"run served last ({sorted(self.served)})")
        step, digest = self.served[lora_id]
        now = trainer.state.global_step
        if step != now or digest != lora_digest(trainer.accelerator.unwrap_model(trainer.model)):
            raise SlmsqlError(f"rollouts: the engine sampled with the adapter of step {step} while the policy is at "
                              f"step {now} (its weights changed since): a stale adapter, the run stops")
        return step

    def close(self) -> None:
        """The engine shut down and dropped, so that its memory (on a GPU, its share of it) is back for whatever this
        process runs next (another run, a sweep's next cell); the adapter copies and the merged base are the engine's
        alone: gone with it."""
        engine, self.engine, self.lora = self.engine, None, None
        if engine is not None:
            # vLLM's own teardown of an in-process engine (executor, distributed state, cached memory; it also undoes
            # the gc.freeze of the engine's start, without which its objects are never collected)
            engine.llm.llm_engine.engine_core.shutdown()
            del engine
            gc.collect()
        shutil.rmtree(self.folder, ignore_errors=True)
        if self.base != self.cfg.model:
            shutil.rmtree(self.base, ignore_errors=True)
