"""From gold questions to model completions: prompts -> batched generation (transformers or, when installed,
vLLM) -> extracted SQL. Shared by evaluate (greedy, one completion) and filter (K samples at a temperature).

Prompts are complete model inputs (chat template already applied), so no special tokens are added.
Sampling is plain temperature + top-p: the checkpoint's own generation defaults (Qwen instruct checkpoints
ship top_k=20 and a repetition_penalty above 1; transformers itself defaults to top_k=50) are overridden so
that results depend only on the arguments here, and match what vLLM's SamplingParams does with them.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from .data import Example
from .errors import SlmsqlError
from .extract import extract_sql
from .prompts import builder_for, render_prompt


def _eos_ids(model, tokenizer) -> list[int]:
    # Instruct checkpoints list several stop tokens (Qwen: <|im_end|> and <|endoftext|>); stop on any of them.
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def _check_args(num_return_sequences, temperature, top_p, max_new_tokens, batch_size) -> None:
    if num_return_sequences < 1:
        raise SlmsqlError(f"num_return_sequences must be >= 1, got {num_return_sequences}")
    if temperature < 0:
        raise SlmsqlError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise SlmsqlError(f"top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 1 or batch_size < 1:
        raise SlmsqlError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens}, {batch_size}")


def generate(
    model,
    tokenizer,
    prompts: list[str],
    *,
    num_return_sequences: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
    backend: str = "transformers",
) -> list[list[str]]:
    """Return, for each prompt in the given order, `num_return_sequences` decoded completions.

    temperature 0 means greedy (its one completion repeated num_return_sequences times). With the transformers
    backend, prompts are batched longest first (least padding) and each batch reseeds torch with
    seed + batch index, so a call's output does not depend on what ran before it (but a sampled completion
    does depend on which prompts share its batch). vLLM seeds each prompt with seed + its index; there
    `model` is a `vllm.LLM` or a path / Hub id, and `tokenizer` is unused.
    """
    _check_args(num_return_sequences, temperature, top_p, max_new_tokens, batch_size)
    if backend == "vllm":
        return _generate_vllm(model, prompts, num_return_sequences, temperature, top_p, max_new_tokens, seed, progress)
    if backend != "transformers":
        raise SlmsqlError(f"unknown generation backend '{backend}' (use transformers or vllm)")
    if not prompts:
        return []

    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    order = sorted(range(len(prompts)), key=lambda i: -lengths[i])
    sampling = temperature > 0
    # Greedy decoding gives one answer; transformers refuses num_return_sequences > 1 without sampling.
    n_gen = num_return_sequences if sampling else 1
    gen_kwargs = dict(
        do_sample=sampling,
        max_new_tokens=max_new_tokens,
        num_return_sequences=n_gen,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=_eos_ids(model, tokenizer),
        repetition_penalty=1.0,  # explicit: otherwise the checkpoint's generation_config fills it
    )
    if sampling:  # top_k=0 disables top-k, which the checkpoint or transformers (50) would otherwise set
        gen_kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
    model.eval()
    results: list[list[str] | None] = [None] * len(prompts)
    with torch.inference_mode(), tqdm(total=len(prompts), unit="prompt", disable=not progress, desc="generate") as bar:
        for b, start in enumerate(range(0, len(order), batch_size)):
            idx = order[start : start + batch_size]
            enc = tokenizer(
                [prompts[i] for i in idx], return_tensors="pt", padding=True, padding_side="left",
                add_special_tokens=False,
            ).to(model.device)
            torch.manual_seed(seed + b)  # also seeds CUDA
            out = model.generate(**enc, **gen_kwargs)
            # Left padding: every row's prompt ends at the same column, so the completion starts there.
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            for j, i in enumerate(idx):
                # generate groups the samples of a prompt together; greedy repeats its single answer
                results[i] = texts[j * n_gen : (j + 1) * n_gen] * (num_return_sequences // n_gen)
            bar.update(len(idx))
    return results


def _generate_vllm(model, prompts, k, temperature, top_p, max_new_tokens, seed, progress) -> list[list[str]]:
    try:
        import vllm
    except ImportError as e:
        raise SlmsqlError("backend 'vllm' was asked for but vllm is not installed (pip install vllm)") from e
    if isinstance(model, vllm.LLM):
        llm = model
    elif isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        llm = vllm.LLM(model=str(model), seed=seed)
    else:
        raise SlmsqlError(f"backend 'vllm' needs a vllm.LLM or a model path / Hub id, got {type(model).__name__}")
    n = k if temperature > 0 else 1  # greedy: one answer, repeated below as with transformers
    params = [
        vllm.SamplingParams(
            n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed + i,
            skip_special_tokens=True,
        )
        for i in range(len(prompts))
    ]
    outputs = llm.generate(prompts, params, use_tqdm=progress)  # returned in input order
    return [[c.text for c in o.outputs] * (k // n) for o in outputs]


def prompts_for(cfg, examples: list[Example], tokenizer) -> list[str]:
    builder = builder_for(cfg)
    return [render_prompt(tokenizer, builder.messages(ex)) for ex in examples]


def complete_prompts(cfg, prompts: list[str], model_and_tokenizer, *, k: int = 1, temperature: float = 0.0,
                     top_p: float = 1.0, seed: int | None = None) -> list[list[str]]:
    """K completions per rendered prompt, with the config's batch, length, seed and backend settings."""
    model, tokenizer = model_and_tokenizer
    return generate(model, tokenizer, prompts, num_return_sequences=k, temperature=temperature, top_p=top_p,
                    max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                    seed=cfg.seed if seed is None else seed, backend=cfg.backend)


def complete(cfg, examples: list[Example], model_and_tokenizer, *, k: int = 1, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None) -> list[list[str]]:
    """K completions per example, in example order, with the config's prompt, batch and length settings."""
    prompts = prompts_for(cfg, examples, model_and_tokenizer[1])
    return complete_prompts(cfg, prompts, model_and_tokenizer, k=k, temperature=temperature, top_p=top_p, seed=seed)


def greedy_answers(cfg, prompts: list[str], model_and_tokenizer) -> list[dict]:
    """The greedy answer to each rendered prompt: the raw completion and the SQL extracted from it. What
    evaluate scores and what the served text2sql model returns (slmsql.text2sql) are both this."""
    out = []
    for (completion,) in complete_prompts(cfg, prompts, model_and_tokenizer):
        sql, how = extract_sql(completion)
        out.append({"completion": completion, "sql": sql, "extracted_by": how})
    return out


def predict(cfg, examples: list[Example], model_and_tokenizer) -> dict[str, dict]:
    """Greedy predictions keyed by id: the raw completion and the SQL extracted from it."""
    prompts = prompts_for(cfg, examples, model_and_tokenizer[1])
    return {ex.id: answer for ex, answer in zip(examples, greedy_answers(cfg, prompts, model_and_tokenizer))}
