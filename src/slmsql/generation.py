"""From gold questions to model completions: prompts -> batched generation -> extracted SQL.

Shared by evaluate (greedy, one completion) and filter (K samples at a temperature).
"""

from __future__ import annotations

from .data import Example
from .extract import extract_sql
from .models import load_model
from .prompts import builder_for, render_prompt
from .sampling import generate


def prompts_for(cfg, examples: list[Example], tokenizer) -> list[str]:
    builder = builder_for(cfg)
    return [render_prompt(tokenizer, builder.messages(ex)) for ex in examples]


def sample(cfg, examples: list[Example], *, k: int = 1, temperature: float = 0.0, top_p: float = 1.0,
           model_and_tokenizer=None) -> list[list[str]]:
    """K completions per example, in example order."""
    model, tokenizer = model_and_tokenizer or load_model(cfg.model, cfg.adapter or None)
    prompts = prompts_for(cfg, examples, tokenizer)
    return generate(model, tokenizer, prompts, num_return_sequences=k, temperature=temperature, top_p=top_p,
                    max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, seed=cfg.seed,
                    backend=cfg.backend)


def predict(cfg, examples: list[Example]) -> dict[str, dict]:
    """Greedy predictions keyed by id: the raw completion and the SQL extracted from it."""
    outs = sample(cfg, examples)
    preds = {}
    for ex, (completion,) in zip(examples, outs):
        sql, how = extract_sql(completion)
        preds[ex.id] = {"completion": completion, "sql": sql, "extracted_by": how}
    return preds
