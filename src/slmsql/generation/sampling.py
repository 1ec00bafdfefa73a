"""From gold questions to model completions: prompts -> batched generation (transformers or, when installed,
vLLM: generation/vllm_engine.py) -> extracted SQL. Shared by evaluate (greedy, one completion) and filter (K samples
at a temperature).

Prompts are complete model inputs (chat template already applied), so no special tokens are added.
Sampling takes temperature, top_p, top_k, min_p and repetition_penalty from the arguments only (the filter
passes its `configs.Sampling` fields, the ones GRPO hands TRL): the checkpoint's own generation defaults (Qwen
instruct checkpoints ship top_k=20 and a repetition_penalty above 1; transformers itself defaults to top_k=50)
never apply, so results depend only on the arguments here, and match what vLLM's SamplingParams does with them.

Sampled completions depend only on (seed, the prompt's key, the sample's index) and the model: every sample
draws its random numbers from its own generator (`sample_seed`), never from torch's global one. So any
partitioning of the questions (chunks, batch sizes, resumed runs, Ray shards on several workers) gives the
same completions on the same machine. The filter keys prompts by question id.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessorList

from slmsql.errors import SlmsqlError
from slmsql.generation import shared_prefix
from slmsql.generation import shared_schema as shared_schema_module
from slmsql.inputs.data import Example
from slmsql.inputs.prompts import answer_prefix, builder_for
from slmsql.policy.models import stop_ids
from slmsql.runtime.seeds import sample_seed
from slmsql.sql.extract import extract_sql


def _check_args(num_return_sequences, temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens,
                batch_size) -> None:
    if num_return_sequences < 1:
        raise SlmsqlError(f"num_return_sequences must be >= 1, got {num_return_sequences}")
    if temperature < 0:
        raise SlmsqlError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise SlmsqlError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0 or not 0 <= min_p <= 1 or repetition_penalty <= 0:
        raise SlmsqlError(f"need top_k >= 0, 0 <= min_p <= 1, repetition_penalty > 0; got {top_k}, {min_p}, "
                          f"{repetition_penalty}")
    if max_new_tokens < 1 or batch_size < 1:
        raise SlmsqlError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens}, {batch_size}")


class _RowSampler:
    """A logits processor that samples each row with its own generator and returns the choice as the only
    finite score, so transformers' greedy step picks it. Rows are prompt-major (prompt j's samples are rows
    j*K .. j*K+K-1), one generator per row, one uniform draw per row and step: a row's tokens depend on its
    own seed and logits only, not on which rows share its batch. The warpers are transformers' own, in the
    order `do_sample=True` applies them (temperature, top-k, top-p, min-p), each only when it changes
    something; the repetition penalty, a processor, is transformers' too and runs before this one (`generate`
    passes it), so the distribution is what `do_sample=True` with these settings would draw from."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float = 1.0, top_k: int = 0,
                 min_p: float = 0.0):
        from transformers.generation.logits_process import (
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        self.generators = [torch.Generator().manual_seed(s) for s in seeds]  # CPU: the same draws on any device
        self.warpers = []
        if temperature != 1:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_k > 0:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1:
            self.warpers.append(TopPLogitsWarper(top_p))
        if min_p > 0:
            self.warpers.append(MinPLogitsWarper(min_p))

    def __call__(self, input_ids, scores):
        scores = scores.float()
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        cdf = torch.softmax(scores, dim=-1).cumsum(dim=-1)
        u = torch.cat([torch.rand(1, generator=g) for g in self.generators]).to(cdf.device)
        # Inverse CDF: the first token whose cumulative probability exceeds u (scaled: cdf[-1] may be 1 - eps).
        choice = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).clamp_(max=cdf.shape[1] - 1)
        out = torch.full_like(scores, -float("inf"))
        return out.scatter_(1, choice, 0.0)


def generate(
    model,
    tokenizer,
    prompts: list[str],
    *,
    num_return_sequences: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
    backend: str = "transformers",
    keys: list[str] | None = None,
    share_prefill: bool = True,
    shared_schema: bool = True,
    done: dict[int, list[str]] | None = None,
    on_batch: Callable[[dict[int, list[str]]], None] | None = None,
) -> list[list[str]]:
    """Return, for each prompt in the given order, `num_return_sequences` decoded completions.

    temperature 0 means greedy (its one completion repeated num_return_sequences times; the other sampling
    arguments are then unused). Sampled (temperature, top_k, top_p, min_p, repetition_penalty as
    `configs.Sampling` describes them; 0 turns top_k and min_p off, 1 top_p and the penalty), completion i
    of a prompt is drawn with `sample_seed(seed, key, i)`, where `keys` name the prompts (the filter passes
    question ids; default: the prompt text), so it does not depend on the batch, the call, or what ran before.
    With the transformers backend, prompts are batched longest first (least padding), `batch_size` prompts
    (x K samples) per batch, each prompt prefilled once for its K samples (`share_prefill`; the same
    distribution, computed once: `shared_prefix.generate`). `shared_schema` (with `share_prefill`): prompts that
    share a token prefix (a database's schema) are batched together and the prefix computed once per group
    (`shared_schema`: the same computation in another float order, near-ties aside). With backend 'vllm', `model` is a
    `vllm_engine.Engine` (see generation/vllm_engine.py), whose prefix caching shares prefixes itself.

    Resume (evaluate): `on_batch` gets each batch's completions by prompt index as soon as the batch is done, and
    `done` gives back those a killed run finished. The batches are planned over all prompts as before and a batch
    whose every prompt is in `done` is skipped, so every batch that runs is the one an uninterrupted run computes.
    """
    _check_args(num_return_sequences, temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens,
                batch_size)
    if keys is None:
        keys = list(prompts)
    elif len(keys) != len(prompts):
        raise SlmsqlError(f"{len(keys)} keys for {len(prompts)} prompts")
    if backend == "vllm":
        from slmsql.generation import vllm_engine

        if not isinstance(model, vllm_engine.Engine):
            raise SlmsqlError(f"backend 'vllm' needs a vllm_engine.Engine, got {type(model).__name__}")
        return vllm_engine.generate(model, tokenizer, prompts, keys, k=num_return_sequences,
                                    temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                    repetition_penalty=repetition_penalty, max_new_tokens=max_new_tokens, seed=seed,
                                    batch_size=batch_size, progress=progress, done=done, on_batch=on_batch)
    if backend != "transformers":
        raise SlmsqlError(f"unknown generation backend '{backend}' (use transformers or vllm)")
    if not prompts:
        return []

    tokens = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    if shared_schema and share_prefill and len(prompts) > 1 and shared_schema_module.supported(model):
        batches = shared_schema_module.plan(tokens, batch_size)
    else:
        order = sorted(range(len(prompts)), key=lambda i: -len(tokens[i]))
        batches = [[(i, 0) for i in order[s:s + batch_size]] for s in range(0, len(order), batch_size)]
    sampling = temperature > 0
    # Greedy decoding gives one answer; sampling repeats each prompt K times (rows prompt-major) and lets
    # _RowSampler choose every token, so transformers itself runs its greedy step (do_sample=False: none of
    # the checkpoint's warpers, top_k included, apply). The repetition penalty is transformers' processor
    # (it skips each row's left padding) and always explicit: otherwise the checkpoint's generation_config
    # fills it in; greedy decoding has none.
    n_gen = num_return_sequences if sampling else 1
    gen_kwargs = dict(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=stop_ids(model.generation_config, tokenizer),  # the rule vLLM's stop_token_ids use too
        repetition_penalty=repetition_penalty if sampling else 1.0,
    )
    model.eval()
    results: list[list[str] | None] = [None] * len(prompts)
    prefixes = shared_schema_module.Prefixes(model, tokens, batches)
    with torch.inference_mode(), tqdm(total=len(prompts), unit="prompt", disable=not progress, desc="generate") as bar:
        for b, batch in enumerate(batches):
            idx = [i for i, _ in batch]
            if done and all(i in done for i in idx):  # finished by a run that was killed: not computed again
                for i in idx:
                    results[i] = done[i]
                bar.update(len(idx))
                continue
            enc = _left_padded([tokens[i][share:] for i, share in batch], tokenizer.pad_token_id, model.device)
            extra = {}
            if sampling:
                enc = {k: v.repeat_interleave(n_gen, dim=0) for k, v in enc.items()}
                seeds = [sample_seed(seed, keys[i], s) for i in idx for s in range(n_gen)]
                extra["logits_processor"] = LogitsProcessorList([_RowSampler(seeds, temperature, top_p, top_k, min_p)])
            head = prefixes.width(b)
            if head:  # each group's prefix computed once, the batch generating from copies of the caches
                out = prefixes.generate(b, model.generate, **enc, n_gen=n_gen, **gen_kwargs, **extra)
            elif share_prefill:  # a prompt's K sample rows prefilled once (shared_prefix.generate)
                out = shared_prefix.generate(model.generate, model, **enc, **gen_kwargs, **extra)
            else:
                out = model.generate(**enc, **gen_kwargs, **extra)
            # Left padding: every row's prompt ends at the same column, so the completion starts there.
            texts = tokenizer.batch_decode(out[:, head + enc["input_ids"].shape[1] :], skip_special_tokens=True)
            for j, i in enumerate(idx):
                # generate groups the samples of a prompt together; greedy repeats its single answer
                results[i] = texts[j * n_gen : (j + 1) * n_gen] * (num_return_sequences // n_gen)
            if on_batch:
                on_batch({i: results[i] for i in idx})
            bar.update(len(idx))
    return results


def _left_padded(rows: list[list[int]], pad_id: int, device) -> dict[str, torch.Tensor]:
    """Token rows left-padded to one width, as the tokenizer pads them (`padding_side="left"`)."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    return {"input_ids": ids, "attention_mask": mask}


def prompts_for(cfg, examples: list[Example], tokenizer) -> list[str]:
    builder = builder_for(cfg)
    return [builder.prompt(tokenizer, ex) for ex in examples]


def complete_prompts(cfg, prompts: list[str], model_and_tokenizer, *, k: int = 1, sampling: dict | None = None,
                     seed: int | None = None, keys: list[str] | None = None, progress: bool = True,
                     done: dict[int, list[str]] | None = None, on_batch=None) -> list[list[str]]:
    """K completions per rendered prompt, with the config's batch, length, seed and backend settings, sampled
    with `sampling` (`configs.Sampling.sampling()`; None: greedy). Samples are keyed by `keys` (question ids;
    the prompt text when None): a prompt's completions do not depend on the other prompts of the call.
    `done`, `on_batch`: resume, as `generate` describes."""
    model, tokenizer = model_and_tokenizer
    # a prompt that ends with the answer's start (answer_prefix) is continued: a completion is that start plus
    # what was generated (so a resumed run's `done` completions, which have it, go in without it)
    head = answer_prefix(cfg)
    if done and head:
        done = {i: [c.removeprefix(head) for c in cs] for i, cs in done.items()}
    whole = lambda got: {i: [head + c for c in cs] for i, cs in got.items()}  # noqa: E731
    out = generate(model, tokenizer, prompts, num_return_sequences=k, **(sampling or {}),
                   max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                   seed=cfg.seed if seed is None else seed, backend=cfg.backend, keys=keys, progress=progress,
                   shared_schema=cfg.shared_schema, done=done,
                   on_batch=on_batch and (lambda got: on_batch(whole(got))))
    return [[head + c for c in cs] for cs in out]


def complete(cfg, examples: list[Example], model_and_tokenizer, *, k: int = 1, sampling: dict | None = None,
             seed: int | None = None, progress: bool = True) -> list[list[str]]:
    """K completions per example, in example order, with the config's prompt, batch and length settings.
    Samples are keyed by question id: a question's completions do not depend on the other examples."""
    prompts = prompts_for(cfg, examples, model_and_tokenizer[1])
    return complete_prompts(cfg, prompts, model_and_tokenizer, k=k, sampling=sampling, seed=seed,
                            keys=[e.id for e in examples], progress=progress)


def answer(completion: str) -> dict:
    """A greedy answer: the raw completion and the SQL extracted from it."""
    sql, how = extract_sql(completion)
    return {"completion": completion, "sql": sql, "extracted_by": how}


def greedy_answers(cfg, prompts: list[str], model_and_tokenizer, *, keys: list[str] | None = None,
                   progress: bool = True) -> list[dict]:
    """The greedy answer to each rendered prompt. What evaluate scores and what the served text2sql model returns
    (slmsql.publishing.text2sql) are both this."""
    return [answer(c) for (c,) in complete_prompts(cfg, prompts, model_and_tokenizer, keys=keys, progress=progress)]


def predict(cfg, examples: list[Example], model_and_tokenizer, *, progress: bool = True,
            known: dict[str, dict] | None = None,
            on_answers: Callable[[dict[str, dict]], None] | None = None) -> dict[str, dict]:
    """Greedy answers keyed by id. Resume: `on_answers` gets each batch's answers by id as soon as they exist,
    `known` gives back those of a killed run (not computed again; the other batches are those an uninterrupted
    run computes: `generate`)."""
    prompts = prompts_for(cfg, examples, model_and_tokenizer[1])
    ids = [e.id for e in examples]
    done = {i: [known[q]["completion"]] for i, q in enumerate(ids) if known and q in known}
    report = (lambda got: on_answers({ids[i]: answer(c) for i, (c,) in got.items()})) if on_answers else None
    completions = complete_prompts(cfg, prompts, model_and_tokenizer, keys=ids, progress=progress, done=done,
                                   on_batch=report)
    return {q: known[q] if q in (known or {}) else answer(c) for q, (c,) in zip(ids, completions)}
