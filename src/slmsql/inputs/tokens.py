"""Token budgets, counted with the model's own tokenizer before any training or sampling.

A real model's prompts (OmniSQL schemas: 1-4k tokens) can outgrow what a stage was set up for, and nothing
downstream says so: TRL's SFT truncates prompt + answer at `max_length` (the answer, the only tokens with a
loss, goes first), and generation past the model's context fails or degrades. So each stage counts first:
- SFT refuses a set in which any example (prompt + answer, as the chat template renders them) is longer than
  `max_length`, naming how many and the longest; `--drop-long` drops them instead, and the count is a metric;
- filter, GRPO and evaluate refuse prompts that leave no room for their generation budget in the model's
  context (`max_position_embeddings` of its config).
The figures are logged as `tokens/*` metrics by the stage.
"""

from __future__ import annotations

import logging

from slmsql.errors import SlmsqlError

log = logging.getLogger(__name__)


def context_length(model: str) -> int | None:
    """The model's context in tokens (its config's max_position_embeddings), None when the config has none."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model))
    value = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(value) if value else None


def count(tokenizer, texts: list[str]) -> list[int]:
    """Token counts of rendered texts (chat template applied already: no special tokens added)."""
    if not texts:
        return []
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _stats(prefix: str, lengths: list[int]) -> dict:
    if not lengths:
        return {}
    return {f"tokens/{prefix}_max": max(lengths), f"tokens/{prefix}_mean": sum(lengths) / len(lengths)}


def check_prompts(tokenizer, prompts: list[str], ids: list[str], *, model: str, new_tokens: int,
                  source: str) -> dict:
    """Refuse prompts that leave fewer than `new_tokens` positions of the model's context; return the
    `tokens/*` metrics."""
    lengths = count(tokenizer, prompts)
    context = context_length(model)
    if context is None:
        log.warning("model %s declares no context length: prompt lengths not checked", model)
    else:
        over = [(n, i) for n, i in zip(lengths, ids) if n + new_tokens > context]
        if over:
            n, i = max(over)
            raise SlmsqlError(
                f"{source}: {len(over)} of {len(prompts)} prompts leave no room for {new_tokens} new tokens in "
                f"model {model}'s context of {context} tokens (longest: question {i!r}, {n} prompt tokens). "
                "Shorten the prompts (--prompt-style compact, fewer --example-values) or the generation budget")
    return {**_stats("prompt", lengths), **({"tokens/context": context} if context else {})}


AT_BUDGET_WARN = 0.1  # a share of answers at the budget past which a run's EX says more about the budget


def answer_budget(tokenizer, answers: list[str], *, new_tokens: int, source: str) -> dict:
    """`tokens/answer_*` metrics of generated answers, and a warning when many used the whole generation budget.

    An answer that reaches `new_tokens` was cut, unless it happened to end there: a model that explains before it
    writes SQL (Qwen2.5-Coder-1.5B-Instruct does, measured in docs/real-model.md) loses its query to the cut, and
    its EX then measures the budget. Lengths are counted by encoding the decoded text again, which can differ from
    the generated tokens by one; `new_tokens - 1` or more counts as reaching it."""
    lengths = count(tokenizer, answers)
    if not lengths:
        return {}
    share = sum(n >= new_tokens - 1 for n in lengths) / len(lengths)
    if share >= AT_BUDGET_WARN:
        log.warning("%s: %.0f%% of %d answers reached the budget of %d new tokens and were probably cut before "
                    "they ended; raise --max-new-tokens, or this run's figures measure the budget",
                    source, 100 * share, len(lengths), new_tokens)
    return {**_stats("answer", lengths), "tokens/answer_at_budget": share}


def sft_lengths(tokenizer, rows: list[dict]) -> tuple[list[int], list[int]]:
    """(prompt, prompt + answer) token counts of TRL's conversational prompt-completion rows, rendered by the
    chat template as SFTTrainer renders them."""
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    full = [tokenizer.apply_chat_template(r["prompt"] + r["completion"], tokenize=False) for r in rows]
    return count(tokenizer, prompts), count(tokenizer, full)


def check_sft(tokenizer, rows: list[dict], ids: list[str], *, max_length: int, drop: bool,
              source: str) -> tuple[list[int], dict]:
    """The indices of the rows to train on and the `tokens/*` metrics. A row longer than `max_length` would be
    truncated from its end, where the answer is: refused unless `drop`, which leaves it out."""
    prompt, full = sft_lengths(tokenizer, rows)
    long = [j for j, n in enumerate(full) if n > max_length]
    if long and not drop:
        j = max(long, key=lambda j: full[j])
        raise SlmsqlError(
            f"{source}: {len(long)} of {len(rows)} examples are longer than max_length={max_length} tokens "
            f"(prompt + answer; longest: {ids[j]!r}, {full[j]} tokens), so their answers would be cut off. "
            "Raise --max-length, shorten the prompts, or leave them out with --drop-long")
    if long:
        log.warning("%s: leaving out %d of %d examples longer than max_length=%d tokens", source, len(long),
                    len(rows), max_length)
    keep = [j for j in range(len(rows)) if full[j] <= max_length]
    if not keep:
        raise SlmsqlError(f"{source}: every example is longer than max_length={max_length} tokens")
    return keep, {**_stats("prompt", prompt), **_stats("example", full), "tokens/dropped_long": len(long)}
