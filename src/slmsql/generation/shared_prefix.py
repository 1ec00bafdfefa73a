"""Shared-prefix GRPO: each distinct prompt of a micro-batch is computed once and its completions attend to it.

Why: text-to-SQL prompts are long (the schema) and completions short, and TRL forwards every row of a group whole:
G x (P + R) tokens where P + G x R carry all the information. Here the rows of a micro-batch that share a prompt
become one packed row (Unsloth's PrefixGrouper does the same; TRL has nothing like it):

    prompt[:-1] | prompt[-1] c1_1 ... c1_n1 | prompt[-1] c2_1 ... c2_n2 | ...

Each completion is a segment that starts with its own copy of the prompt's last token, so every completion's first
token is predicted at a position of its own (TRL's fused LM head reads one label per position). A 4-D attention
mask lets a segment see the shared prompt and itself (causally), never another segment; every token keeps the
position id the plain row gives it (its column: transformers' default), so RoPE sees what it sees there.
Completion padding is dropped, not computed.

Exact: each completion token's attention reads the same keys and values as on the plain path, and the prompt's
activations are computed once, so their gradient is the sum over the segments that read them: the sum of the G
copies' gradients on the plain path. Only the float summation order differs (the trainer's first-step self-check
measures it).

`packed_logps` is the computation; `Packing.of` the layout; `generate` the prefill of each prompt once;
`shuffle_groups` micro-batches of whole groups; `forward_flops` the cost model; `partial_attention` the models
the layout cannot serve. slmsql.training.shared_prefix_trainer puts them into TRL's GRPOTrainer, after a
self-check against TRL's own path.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

# The attention implementations that take a custom 4-D mask as transformers passes it (flash attention does not).
MASKED_ATTENTION = ("sdpa", "eager")


def _prefix_ones(mask: torch.Tensor) -> bool:
    """Every row is ones then zeros (a completion mask) -- the only layout the packing reads."""
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> dict[tuple, list]:
    """A micro-batch's rows by prompt (its unpadded tokens), in order of first appearance."""
    plen = input_ids.size(1) - logits_to_keep
    groups: dict[tuple, list[int]] = {}
    for r in range(input_ids.size(0)):
        groups.setdefault(tuple(input_ids[r, :plen][attention_mask[r, :plen].bool()].tolist()), []).append(r)
    return groups


@dataclass
class Packing:
    """One micro-batch in the shared-prefix layout (module docstring).

    input_ids, position_ids, segment, shift_labels: (rows, width); segment -1 is padding, 0 the shared prompt,
    s >= 1 the s-th completion; `rows`, `cols`: where completion token k of plain row r is scored
    (`plain_rows`, `plain_cols` give r and k)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment: torch.Tensor
    shift_labels: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    plain_rows: torch.Tensor
    plain_cols: torch.Tensor
    shape: tuple[int, int]  # the plain output: (plain rows, completion width)

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, pad_id: int = 0):
        """The packing of TRL's (left-padded prompt | right-padded completion) rows, or None when the masks are not
        that layout (then the plain path applies)."""
        width = input_ids.size(1)
        plen = width - logits_to_keep
        prompt_mask, completion_mask = attention_mask[:, :plen], attention_mask[:, plen:]
        if plen < 1 or not _prefix_ones(prompt_mask.flip(1)) or not _prefix_ones(completion_mask) \
                or not bool(prompt_mask[:, -1].all()):
            return None
        groups = prompt_groups(input_ids, attention_mask, logits_to_keep)
        lengths = completion_mask.sum(1).tolist()
        seqs, out = [], {"rows": [], "cols": [], "plain_rows": [], "plain_cols": []}
        for p, (prompt, members) in enumerate(groups.items()):
            pad = plen - len(prompt)
            ids, pos, seg, lab = list(prompt[:-1]), list(range(pad, plen - 1)), [0] * (len(prompt) - 1), \
                [-100] * (len(prompt) - 1)
            for s, r in enumerate(members, start=1):
                n = int(lengths[r])
                if n == 0:  # nothing scored (a masked-out completion): the plain path gives zeros too
                    continue
                completion = input_ids[r, plen:plen + n].tolist()
                out["rows"] += [p] * n
                out["cols"] += range(len(ids), len(ids) + n)
                out["plain_rows"] += [r] * n
                out["plain_cols"] += range(n)
                ids += [prompt[-1], *completion]
                pos += range(plen - 1, plen + n)
                seg += [s] * (n + 1)
                lab += [*completion, -100]
            seqs.append((ids, pos, seg, lab))
        longest = max(len(s[0]) for s in seqs)

        def column(i, fill, dtype=torch.long):
            return torch.tensor([s[i] + [fill] * (longest - len(s[i])) for s in seqs], dtype=dtype,
                                device=input_ids.device)

        index = {k: torch.tensor(v, dtype=torch.long, device=input_ids.device) for k, v in out.items()}
        return cls(column(0, pad_id, input_ids.dtype), column(1, 0), column(2, -1), column(3, -100), **index,
                   shape=(input_ids.size(0), logits_to_keep))

    def attention_mask(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """(rows, 1, width, width): a token sees earlier tokens of its own segment and the shared prompt; a padding
        position sees itself only (a query row with no key would be NaN). Boolean (True: attend), or additive in
        `dtype` for eager attention."""
        q, k = self.segment.unsqueeze(2), self.segment.unsqueeze(1)
        width = self.segment.size(1)
        causal = torch.ones(width, width, dtype=torch.bool, device=q.device).tril()
        mask = causal & (k >= 0) & ((k == 0) | (k == q))
        mask |= torch.eye(width, dtype=torch.bool, device=q.device)
        mask = mask.unsqueeze(1)
        if dtype is None:
            return mask
        return torch.zeros(mask.shape, dtype=dtype, device=q.device).masked_fill(~mask, torch.finfo(dtype).min)

    @property
    def tokens(self) -> int:
        """Tokens computed (padding included), to compare with the plain path's rows x width."""
        return self.input_ids.numel()

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Per-token values in the packed layout -> the plain layout (zeros where nothing is scored)."""
        out = packed.new_zeros(self.shape)
        return out.index_put((self.plain_rows, self.plain_cols), packed[self.rows, self.cols])


def cost_dims(model) -> tuple[int, int]:
    """`model`'s two costs for `forward_flops`: the weights every token is multiplied by (every matrix but the input
    embedding, a lookup; the LM head counts, as TRL's fused head projects every position of a row, and so do LoRA's
    matrices), and the FLOPs of one query-key pair over all layers (4 x heads x head_dim per layer: Q.K and the sum
    of V)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    linear = sum(p.numel() for p in model.parameters() if p.ndim == 2 and p is not embedding)
    if head is not None and head.weight is embedding:  # tied: the lookup's matrix is the head too
        linear += embedding.numel()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return linear, 4 * heads * head_dim * config.num_hidden_layers


def forward_flops(rows: int, width: int, dims: tuple[int, int], causal: bool = False) -> float:
    """A forward's FLOPs over `rows` rows of `width` tokens, padding included: each token through the weights
    (2 x dims[0]), and each query-key pair of the attention (dims[1]) -- all width x width of them, as SDPA computes
    under any explicit mask, or about half when `causal` (no padding: transformers drops the mask and SDPA's causal
    kernels skip the future). The backward and a checkpointing recompute scale both terms alike, so comparing
    forwards compares the step. A floor on work, not a clock: what either path pays beyond it (kernel efficiency at
    its shapes, the packing's Python) is left out; both run the same kernels."""
    linear, pair = dims
    pairs = width * (width + 1) / 2 if causal else width * width
    return rows * (2 * linear * width + pair * pairs)


def forward_costs(input_ids: torch.Tensor, attention_mask: torch.Tensor, packing: Packing, dims) -> tuple[float, float]:
    """(plain, packed) forward FLOPs of one micro-batch: TRL's rows as they are, and the packing of them."""
    plain = forward_flops(*input_ids.shape, dims, causal=bool(attention_mask.all()))
    return plain, forward_flops(*packing.input_ids.shape, dims)


def attention_implementation(model) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) or "sdpa"


def partial_attention(model) -> str | None:
    """Why some layer of `model` would not attend as the packed layout's 4-D mask says, or None when every layer is
    full attention. A sliding window (Mistral's `sliding_window`, Qwen2's `use_sliding_window`, Gemma's
    `sliding_attention` layers) cannot be kept: transformers hands a ready 4-D mask to every layer as it is
    (masking_utils), so a windowed layer would attend to all the packed mask allows, and in a packed row a
    completion sits further from its prompt than in its plain row anyway. Other layer types (linear attention,
    state-space, convolution) read no mask at all."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types = set(getattr(config, "layer_types", None) or ())
    window = getattr(config, "sliding_window", None)
    if not types and window and getattr(config, "use_sliding_window", True):
        types = {"sliding_attention"}  # Mistral's: a window on every layer whenever sliding_window is set
    other = sorted(types - {"full_attention"})
    if not other:
        return None
    name = getattr(config, "_name_or_path", "") or config.model_type
    return (f"{name} has {' and '.join(other)} layers" + (f" (sliding_window {window})" if window else "")
            + ": the packed layout's 4-D mask would reach them unwindowed or not at all (shared prefix needs every "
              "layer to be full attention)")


def packed_logps(model, packing: Packing, compute_entropy: bool = False):
    """Per-token log-probs (and entropies) of the packing's completions in the plain layout, by TRL's fused LM head
    (`model(..., fused_lm_head=True)`: temperature and everything else as TRL set it up)."""
    eager = attention_implementation(model) == "eager"
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype if eager else None
    outputs = model(input_ids=packing.input_ids, attention_mask=packing.attention_mask(dtype),
                    position_ids=packing.position_ids, shift_labels=packing.shift_labels, fused_lm_head=True)
    logps = packing.unpack(outputs.log_probs)
    entropies = packing.unpack(outputs.entropy) if compute_entropy else None
    return logps, entropies


def chunks(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, batch_size: int):
    """Row indices in chunks of at most `batch_size` rows that keep a prompt's rows together where they fit (TRL's
    `batch_size` bounds the rows forwarded at once)."""
    out, current = [], []
    for members in prompt_groups(input_ids, attention_mask, logits_to_keep).values():
        for start in range(0, len(members), batch_size):
            part = members[start:start + batch_size]
            if current and len(current) + len(part) > batch_size:
                out.append(current)
                current = []
            current = current + part
    return out + ([current] if current else [])


def generate(generate_fn, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs):
    """`generate_fn(input_ids=, attention_mask=, **kwargs)` (a model's `generate`) with each distinct prompt row
    prefilled once: the cache of all its tokens but the last is computed for the distinct rows (with the position ids
    generate itself derives from the mask) and copied to their repeats; generate then runs from the last prompt
    token, as it would have from the first. Left-padded rows only; anything else, or a cache of generate's own
    choosing, goes to `generate_fn` as it is."""
    plain = functools.partial(generate_fn, input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    config = kwargs.get("generation_config")
    if input_ids.size(1) < 2 or "cache" in kwargs or "past_key_values" in kwargs \
            or getattr(config, "cache_implementation", None) or not bool(attention_mask[:, -1].all()):
        return plain()
    keyed = torch.where(attention_mask.bool(), input_ids, -1)
    distinct, inverse = torch.unique(keyed, dim=0, return_inverse=True)
    if distinct.size(0) == input_ids.size(0):
        return plain()
    rows = torch.arange(input_ids.size(0), device=input_ids.device)
    first = torch.full((distinct.size(0),), input_ids.size(0), device=input_ids.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    ids, mask = input_ids[first, :-1], attention_mask[first, :-1]
    extra = {}
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PeftModel generates with it
    if "position_ids" in inspect.signature(inner.forward).parameters:  # generate's own rule, as generate applies it
        extra["position_ids"] = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1, **extra)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return plain()
    cache.batch_select_indices(inverse)
    return plain(cache=cache)


def shuffle_groups(batch: dict, group: int) -> dict | None:
    """TRL's shuffle of a generation batch before it is split into micro-batches, by whole groups: the rows of a
    prompt stay together, so each micro-batch holds whole groups to share (TRL shuffles rows: a micro-batch of 16
    from 8 prompts x 8 would hold ~2 rows of each). None when the rows are not consecutive groups of `group` copies
    of a prompt. One optimizer step still trains on the same rows: with steps_per_generation equal to
    gradient_accumulation_steps (TRL's default) and a loss normalised over the generation batch (dapo, dr_grpo,
    grpo), its gradient is the plain path's."""
    ids, mask = batch.get("prompt_ids"), batch.get("prompt_mask")
    if ids is None or mask is None or group < 1 or ids.size(0) % group:
        return None
    prompts = (ids * mask).view(-1, group, ids.size(1))
    if not bool((prompts == prompts[:, :1]).all()):
        return None
    order = (torch.randperm(ids.size(0) // group).unsqueeze(1) * group + torch.arange(group)).flatten()

    def permute(v):
        if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
            return v
        return v[order] if isinstance(v, torch.Tensor) else [v[i] for i in order]

    return {key: permute(value) for key, value in batch.items()}
