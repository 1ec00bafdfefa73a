"""Scripted completions for GRPO runs: the sampling outcome a test needs, constructed instead of hoped for.

Why: a test that needs a group whose correctness varies, or an all-wrong group whose shaped rewards still vary,
cannot get it from the policy's sampler: float results differ between machines (CPU kernels, thread counts), so
what a tiny policy samples at temperature 0.8 differs too, and a test that hoped for an outcome went red on a
machine where every group came out alike. Here `transformers`' `generate` is replaced for the test: row i of a
prompt's group of G gets `answer(prompt_text, i % G)`, tokenized and closed with eos. The trainer still computes
the policy's log-probabilities of these completions and trains on them, so rewards, advantages, the gate, dynamic
sampling and the optimizer step run for real; only the sampler is scripted.

Use inside a test or fixture: `scripted.install(monkeypatch, tokenizer_dir, answer, group=G)`; `answer` may
return None for a row the policy's own sampler (or tests/rowseeded.py's) should write.
`question_of(rows)` maps a rendered prompt back to its gold row (by the question text it contains).
"""

from __future__ import annotations

WRONG = "```sql\nSELECT 'scripted' AS wrong\n```"  # runs, matches no gold: execution 0.1, format 0.2
NO_SQL = "no sql here"  # no SQL block: execution 0, format 0


def right(row) -> str:
    return f"```sql\n{row['sql']}\n```"


def question_of(rows):
    """prompt text -> the row whose question it holds (the longest such question, should one contain another)."""
    def find(prompt: str) -> dict:
        found = [r for r in rows if r["question"] in prompt]
        assert found, f"no scripted row's question is in the prompt {prompt[-200:]!r}"
        return max(found, key=lambda r: len(r["question"]))
    return find


def scripted_generate(tokenizer_dir, answer, group: int, sample=None, served: list | None = None):
    """transformers' `generate`, scripted: row i of a prompt's group of G gets `answer(prompt_text, i % G)`, plain
    text tokenized and closed with eos; where `answer` returns None, the row keeps what `sample` (an underlying
    generate, e.g. tests/rowseeded.py's) drew for it. Each scripted text is appended to `served`."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    def generate(self, input_ids=None, attention_mask=None, generation_config=None, **kwargs):
        # TRL lays a generation batch out as consecutive groups of G copies of a prompt
        texts = [answer(tokenizer.decode(input_ids[i][attention_mask[i].bool()]), i % group)
                 for i in range(input_ids.size(0))]
        sampled = None
        if any(t is None for t in texts):
            sampled = sample(self, input_ids=input_ids, attention_mask=attention_mask,
                             generation_config=generation_config, **kwargs)[:, input_ids.size(1):]
        rows, limit = [], generation_config.max_new_tokens
        for i, text in enumerate(texts):
            if text is None:
                rows.append(sampled[i])
                continue
            ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            assert len(ids) <= limit, f"scripted completion of {len(ids)} tokens > max_new_tokens {limit}: {text!r}"
            if served is not None:
                served.append(text)
            rows.append(torch.tensor(ids, dtype=input_ids.dtype))
        width = max(r.size(0) for r in rows)
        pad = generation_config.pad_token_id
        completions = torch.stack([F.pad(r, (0, width - r.size(0)), value=pad) for r in rows])
        return torch.cat([input_ids, completions], dim=1)

    return generate


def install(monkeypatch, tokenizer_dir, answer, group: int, sample=None) -> list[str]:
    """Replace `GenerationMixin.generate` for the rest of the test (see `scripted_generate`); returns the list
    every scripted completion is appended to (what was served, in order)."""
    from transformers.generation.utils import GenerationMixin

    served: list[str] = []
    sample = sample or GenerationMixin.generate  # rows `answer` leaves to the policy's own sampler
    monkeypatch.setattr(GenerationMixin, "generate", scripted_generate(tokenizer_dir, answer, group, sample, served))
    return served


def right_and_no_sql_first(rows):
    """An `answer` for groups that must hold a reward difference while the sampler still writes the rest: the
    first completion of every group is the gold SQL (correct), the second has no SQL (reward 0), others sampled."""
    find = question_of(rows)
    return lambda prompt, i: right(find(prompt)) if i == 0 else NO_SQL if i == 1 else None


def pin(monkeypatch, completions: dict[str, list[str]] | None = None, answers: dict[str, str] | None = None):
    """Filter and evaluate (in this process) as they are, the real model generating, except for fixed rows:
    question id -> its K completions (`completions`, what filter samples) or its greedy completion (`answers`,
    what evaluate predicts). A test that needs a band question or a wrong answer pins one instead of hoping."""
    from slmsql.generation import sampling as generation
    from slmsql.sql.extract import extract_sql

    complete, predict = generation.complete, generation.predict

    def pinned_complete(cfg, examples, *args, **kwargs):
        got = complete(cfg, examples, *args, **kwargs)
        return [list((completions or {}).get(e.id, g)) for e, g in zip(examples, got)]

    def pinned_predict(cfg, examples, *args, **kwargs):
        got = predict(cfg, examples, *args, **kwargs)
        for qid, text in (answers or {}).items():
            if qid in got:
                sql, how = extract_sql(text)
                got[qid] = {"completion": text, "sql": sql, "extracted_by": how}
        return got

    monkeypatch.setattr(generation, "complete", pinned_complete)
    monkeypatch.setattr(generation, "predict", pinned_predict)
