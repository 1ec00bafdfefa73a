"""Evaluation and the filter with the prompt prefix that questions share computed once per group.

Why: on a CPU a real model's evaluation is mostly prompt prefill, and a schema prompt is mostly schema: Spider dev
puts ~50 questions on each of its 20 databases, so the plain path computes each schema ~50 times. Here the prompts of
one `sampling.generate` call are grouped by their common token prefix (`plan`: found from the tokens, not from
db_id; in practice the system message and one database's schema, up to the question), the prefix's KV cache is
computed once per group (`prefix_cache`), and each batch of the group generates from a copy of it (`generate`).

Layout: a batch's rows are `prefix | padding | suffix`: the suffixes (different lengths) are left-padded after the
prefix, the padding masked. Position ids are the attention mask's cumulative sum (generate's own rule), so every real
token keeps the position it has in its unpadded prompt and attends to the same keys and values (the prefix, then its
own suffix) as on the plain left-padded path: the same computation in another float order, so greedy answers agree
but at near-ties (tests/neartie.py). The K sample rows of one prompt (the filter) share more: each distinct suffix
but its last token is computed once from the prefix cache and copied to its K rows, as `shared_prefix.generate`
does for whole prompts; the rows' samplers and seeds are unchanged.

`supported` names the models this layout cannot serve (no position ids taken, windowed attention, a cache without
batch copies): they take the plain path.
"""

from __future__ import annotations

import inspect
import time
from contextlib import contextmanager

import torch
from transformers import DynamicCache

from slmsql.generation import shared_prefix


def supported(model) -> bool:
    """Whether `model` computes the `prefix | padding | suffix` layout as the plain one: it must take position ids
    (else it would number columns, padding included) and attend fully on every layer (a window counts columns)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    takes_positions = "position_ids" in inspect.signature(inner.forward).parameters
    return takes_positions and shared_prefix.partial_attention(model) is None


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def groups(tokens: list[list[int]]) -> list[tuple[int, list[int]]]:
    """The prompts (indices into `tokens`) as (prefix length, members) groups that compute the fewest prompt tokens in
    all: a group computes its common prefix once and each member's rest. Sorted by tokens, prompts with a long common
    prefix are neighbours, and the best grouping is a partition of that order into runs (a dynamic programme over
    it). A prefix stops one token short of its shortest member (generate needs one new token a row); a group of one
    has prefix 0 (nothing to share)."""
    order = sorted(range(len(tokens)), key=lambda i: tokens[i])
    n = len(order)
    lengths = [len(tokens[i]) for i in order]
    adjacent = [_common(tokens[order[k]], tokens[order[k + 1]]) for k in range(n - 1)]
    best, cut = [0] * (n + 1), [0] * (n + 1)  # best[j]: fewest tokens for the first j; cut[j]: where its group starts
    for j in range(1, n + 1):
        best[j], cut[j] = best[j - 1] + lengths[j - 1], j - 1
        p, shortest, total = 1 << 60, lengths[j - 1], lengths[j - 1]
        for i in range(j - 2, -1, -1):  # the group order[i:j]
            p, shortest, total = min(p, adjacent[i]), min(shortest, lengths[i]), total + lengths[i]
            share = min(p, shortest - 1)
            if share <= 0:
                break  # a longer run shares nothing either
            cost = best[i] + total - share * (j - i - 1)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    out, j = [], n
    while j > 0:
        i = cut[j]
        members = order[i:j]
        share = min(min(adjacent[i:j - 1]), min(lengths[i:j]) - 1) if j - i > 1 else 0
        out.append((share, members))
        j = i
    return out[::-1]


def plan(tokens: list[list[int]], batch_size: int) -> list[list[tuple[int, int]]]:
    """Batches of (prompt index, its group's prefix length), cut every `batch_size` rows across group boundaries, so
    a batch is as full as on the plain path (a decode step costs about as much for 2 rows as for 16 on a CPU). A
    group's members are consecutive (its prefix's cache is needed by consecutive batches only, then dropped), longest
    rest first, and groups go by their longest rest (a prompt that shares nothing is a group of its own, its rest
    the whole prompt): the plain path's longest-first order, on what is left to compute, for the least padding."""
    rows = []
    for share, members in groups(tokens):
        rest = sorted((len(tokens[i]) - share, i) for i in members)[::-1]
        rows.append((rest[0][0], [(i, share) for _, i in rest]))
    rows.sort(key=lambda g: -g[0])
    flat = [r for _, members in rows for r in members]
    return [flat[s:s + batch_size] for s in range(0, len(flat), batch_size)]


def prefix_cache(model, ids: list[int]):
    """The KV cache of `ids` (one row): computed once per group, copied into each batch that needs it."""
    out = model(input_ids=torch.tensor([ids], device=model.device), use_cache=True, logits_to_keep=1)
    return getattr(out, "cache", None) or out.past_key_values


def _batch_cache(caches: list, rows: torch.Tensor, width: int):
    """A cache of `rows` (indices into `caches`, one-row caches or None for no prefix), each row's prefix left-padded
    with zeros to `width`: padding is masked, never read (a DynamicCache built from its tensors, the public way)."""
    layers = [list(c) for c in caches if c is not None]
    data = []
    for i in range(len(layers[0])):
        keys, values = [], []
        ref_k, ref_v = layers[0][i][0], layers[0][i][1]
        for c in caches:
            k, v = (ref_k[:, :, :0], ref_v[:, :, :0]) if c is None else (c.layers[i].keys, c.layers[i].values)
            keys.append(torch.nn.functional.pad(k, (0, 0, width - k.size(-2), 0)))
            values.append(torch.nn.functional.pad(v, (0, 0, width - v.size(-2), 0)))
        data.append((torch.cat(keys)[rows], torch.cat(values)[rows]))
    return DynamicCache(ddp_cache_data=data)


def generate(generate_fn, model, prefixes: list[list[int]], caches: list, which: list[int], input_ids: torch.Tensor,
             attention_mask: torch.Tensor, **kwargs):
    """`generate_fn` (a model's `generate`) on the rows `prefix | input_ids` (the suffixes, left-padded), row r's
    prefix `prefixes[which[r]]` (its one-row cache `caches[which[r]]`; an empty prefix, None), left-padded to the
    longest; returns generate's output: those rows, the new tokens after them."""
    rows, device = input_ids.size(0), input_ids.device
    width = max(len(p) for p in prefixes)
    pad = lambda r: [0] * (width - len(r))  # noqa: E731
    head = torch.tensor([pad(prefixes[w]) + prefixes[w] for w in which], device=device)
    head_mask = torch.tensor([pad(prefixes[w]) + [1] * len(prefixes[w]) for w in which], device=device)
    ids = torch.cat([head, input_ids], 1)
    mask = torch.cat([head_mask.to(attention_mask.dtype), attention_mask], 1)
    # the K rows of a sampled prompt are equal: each distinct row's suffix (but its last token) is computed once
    keyed = torch.where(mask.bool(), ids, -1)
    distinct, inverse = torch.unique(keyed, dim=0, return_inverse=True)
    first = torch.full((distinct.size(0),), rows, device=device)
    first = first.scatter_reduce(0, inverse, torch.arange(rows, device=device), reduce="amin")
    cache = _batch_cache(caches, torch.tensor(which, device=device)[first], width)
    if input_ids.size(1) > 1:
        m = mask[first, :-1]
        positions = (m.long().cumsum(-1) - 1).masked_fill(m == 0, 0)[:, width:]  # generate's rule, over the holes
        model(input_ids=input_ids[first, :-1], attention_mask=m, position_ids=positions, cache=cache, use_cache=True,
              logits_to_keep=1)
    cache.batch_select_indices(inverse)
    return generate_fn(input_ids=ids, attention_mask=mask, cache=cache, **kwargs)


class Prefixes:
    """A plan's prefixes, each computed once (`prefix_cache`) when its group's first batch comes and dropped after
    its last (a group's batches are consecutive); `generate` runs batch `b` of the plan from them."""

    def __init__(self, model, tokens: list[list[int]], batches: list[list[tuple[int, int]]]):
        self.model, self.batches, self.caches = model, batches, {}
        self.prefixes = [[tuple(tokens[i][:share]) for i, share in batch] for batch in batches]

    def width(self, b: int) -> int:
        """Batch b's prefix columns (0: nothing shared, the plain path's batch)."""
        return max(len(p) for p in self.prefixes[b])

    def generate(self, b: int, generate_fn, input_ids, attention_mask, n_gen: int, **kwargs):
        """Batch b's rows (`n_gen` consecutive rows a prompt) from its prefixes' caches."""
        mine = self.prefixes[b]
        used = list(dict.fromkeys(mine))
        for p in used:
            if p and p not in self.caches:
                self.caches[p] = prefix_cache(self.model, list(p))
        which = [used.index(p) for p in mine for _ in range(n_gen)]
        out = generate(generate_fn, self.model, [list(p) for p in used], [self.caches.get(p) for p in used], which,
                       input_ids, attention_mask, **kwargs)
        later = set(self.prefixes[b + 1]) if b + 1 < len(self.batches) else set()
        for p in set(used) - later:
            self.caches.pop(p, None)
        return out


@contextmanager
def counting_prefill(model):
    """Counts, while open, the prompt work of `model`'s forwards: every forward outside `generate` (the prefix and
    suffix forwards here) and the first of each `generate` call; the decode steps after it are not counted. Yields
    {"positions": rows x width computed (padding included), "tokens": the real ones (mask ones), "forwards": n,
    "seconds": the wall time those forwards took}.
    For the bench and the tests: what "each schema computed once" saves, and where the rest of the time goes."""
    counts = {"positions": 0, "tokens": 0, "forwards": 0, "seconds": 0.0}
    state = {"in_generate": False, "first": False, "started": None}
    inner_generate = model.generate

    def wrapped_generate(*args, **kwargs):
        state["in_generate"], state["first"] = True, True
        try:
            return inner_generate(*args, **kwargs)
        finally:
            state["in_generate"] = False

    def hook(module, args, kwargs):
        if state["in_generate"] and not state["first"]:
            return
        state["first"] = False
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        counts["positions"] += ids.numel()
        counts["tokens"] += int(mask[:, -ids.size(1):].sum()) if isinstance(mask, torch.Tensor) and mask.ndim == 2 \
            else ids.numel()
        counts["forwards"] += 1
        state["started"] = time.perf_counter()

    def done(module, args, output):
        if state["started"] is not None:
            counts["seconds"] += time.perf_counter() - state["started"]
            state["started"] = None

    own = vars(model).get("generate")  # a wrapper someone set on the instance stays after this one
    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    after = model.register_forward_hook(done)
    model.generate = wrapped_generate
    try:
        yield counts
    finally:
        handle.remove()
        after.remove()
        if own is None:
            del model.generate
        else:
            model.generate = own
