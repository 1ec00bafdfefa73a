"""The near-tie rule: two float paths of one model (batch sizes, thread counts, engines) may part only where the
model was undecided. Float summation order differs between them by ~1e-6 relative, so:

- a greedy step parts only where the two best logits were within TIE of each other (`greedy_gap`: the gap where
  a regenerated greedy completion leaves either text, as tests/test_vllm.py measures it);
- a sampled step (generation.sampling's `_RowSampler`: one uniform draw per row and step, inverse CDF) parts only
  where the draw fell within DRAW_TIE of a boundary of the cumulative distribution (`DrawMargins` records, for
  each row's seed, how close each of its draws came to one).

Anywhere else the two paths give the same tokens on every machine; a path that computes another model (a dropped
adapter, a wrong mask) parts where the model was decisive, and fails the rule.
"""

from __future__ import annotations

from collections import defaultdict

import torch

TIE = 1e-2  # logits: two float paths of one fp32 model differ by ~1e-5; a trained model's decisions by ~1
DRAW_TIE = 1e-4  # probability mass: two float paths' cumulative distributions differ by ~1e-6


def greedy_gap(model, tokenizer, prompt: str, texts: list[str], max_new_tokens: int) -> float:
    """Greedy is regenerated one prompt at a time (a third float path), with its logits; at the first step where its
    text leaves either of `texts`, the gap between its two best tokens, taken over the tokens of the word that
    step is in (BPE may split a word differently on two paths before the texts differ)."""
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, do_sample=False, max_new_tokens=max_new_tokens, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
    new = out.sequences[0, ids["input_ids"].shape[1]:]
    word_start, found = 0, None
    for k in range(len(new)):
        text = tokenizer.decode(new[:k + 1], skip_special_tokens=True)
        if not all(t.startswith(text) for t in texts):
            found = k
            break
        if text[-1:].isspace() or not text[-1:].isalnum():
            word_start = k + 1
    if found is None:  # the regenerated text is a prefix of both: they part where one of them stopped
        found = len(new) - 1
    top2 = [out.logits[s][0].float().topk(2).values for s in range(word_start, found + 1)]
    return min(float(v[0] - v[1]) for v in top2)


def assert_greedy_same_but_near_ties(model, tokenizer, prompts: list[str], a: list, b: list, max_new_tokens: int):
    """`a` and `b` (per prompt, a list of completions, or one completion) are the same but where a near-tie parts
    them."""
    gaps = {}
    for prompt, x, y in zip(prompts, a, b, strict=True):
        if x != y:
            x, y = (x, y) if isinstance(x, str) else (x[0], y[0])
            gaps[prompt] = greedy_gap(model, tokenizer, prompt, [x, y], max_new_tokens)
    assert all(g < TIE for g in gaps.values()), f"greedy answers part where the model was decisive: {gaps}"
    return gaps


class DrawMargins:
    """While installed (a pytest monkeypatch), every `_RowSampler` draw records, under its row's seed, how far the
    scaled uniform fell from the nearer edge of the token it chose on the cumulative distribution. The draws
    themselves are unchanged (each row's generator is read from a copy of its state)."""

    def __init__(self, monkeypatch):
        from slmsql.generation import sampling

        self.margins: dict[int, list[float]] = defaultdict(list)
        init, call = sampling._RowSampler.__init__, sampling._RowSampler.__call__
        margins = self.margins

        def recording_init(sampler, seeds, *args, **kwargs):
            init(sampler, seeds, *args, **kwargs)
            sampler._seeds = list(seeds)

        def recording_call(sampler, input_ids, scores):
            warped = scores.float()
            for warp in sampler.warpers:
                warped = warp(input_ids, warped)
            cdf = torch.softmax(warped, dim=-1).cumsum(dim=-1)
            for row, (seed, g) in enumerate(zip(sampler._seeds, sampler.generators)):
                peek = torch.Generator()
                peek.set_state(g.get_state())
                x = float(torch.rand(1, generator=peek)) * float(cdf[row, -1])
                c = int(torch.searchsorted(cdf[row], torch.tensor([x]), right=True).clamp(max=cdf.shape[1] - 1))
                lo = float(cdf[row, c - 1]) if c > 0 else 0.0
                margins[seed].append(min(x - lo, float(cdf[row, c]) - x))
            return call(sampler, input_ids, scores)

        monkeypatch.setattr(sampling._RowSampler, "__init__", recording_init)
        monkeypatch.setattr(sampling._RowSampler, "__call__", recording_call)

    def near_tie(self, seed: int) -> bool:
        """Whether some draw of the row with this seed fell within DRAW_TIE of an edge (in any run recorded)."""
        return any(m < DRAW_TIE for m in self.margins.get(seed, ()))


def assert_samples_same_but_near_ties(draws: DrawMargins, seed: int, keys: list[str], a: list[list[str]],
                                      b: list[list[str]]):
    """Sampled completions per prompt (`keys` name the prompts, as generation.sampling.generate's `keys`) the same
    in `a` and `b` but for rows that drew within DRAW_TIE of an edge."""
    from slmsql.runtime.seeds import sample_seed

    parted = [(key, i) for key, x, y in zip(keys, a, b, strict=True) for i, (s, t) in enumerate(zip(x, y, strict=True))
              if s != t]
    bad = [(key, i) for key, i in parted if not draws.near_tie(sample_seed(seed, key, i))]
    assert not bad, f"samples part where no draw was near an edge: {bad}"
    return parted
