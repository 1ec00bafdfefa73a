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

`packed_logps` is the computation; `Packing.of` the layout; `trainer_class` puts it into TRL's GRPOTrainer, where
every per-token log-prob TRL takes goes through one method (`_get_per_token_logps_and_entropies`: the policy's in
the loss, the old policy's, the reference model's), and micro-batches hold whole groups.

Nothing changes TRL's path before the self-check has passed: the first generation batch is generated, scored and
(where TRL takes them) its old and reference log-probs computed TRL's way; then its first micro-batch is checked,
and only then is it shuffled, by groups when the check passed and by rows (TRL's) when it did not. A run that falls
back, at its start or at the check, is TRL's own path from its first step to its last: the same micro-batches in
the same order and the same generate calls.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

TAG = "slmsql.shared_prefix"  # a run's tag: what --shared-prefix did (on, with the self-check's figure; or why not)
# The attention implementations that take a custom 4-D mask as transformers passes it (flash attention does not).
MASKED_ATTENTION = ("sdpa", "eager")
# A generation batch's fields that carry images: the packed layout is text-only, so such a run stays on the plain path.
MULTIMODAL = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids",
              "mm_token_type_ids")
# The largest |log p(shared) - log p(plain)| the self-check accepts. It compares in float32 (float64 for a float64
# model) whatever the run computes in, as nothing but summation order separates the two paths there: measured on
# SmolLM2-135M on a CPU (bench/prefix_tolerance.py; 3 micro-batches, prompts of 220-300 tokens, 64-token
# completions) float32 gives 2-3e-5 and a wrong mask 2.4-6.4. In bfloat16 the paths' own rounding is 0.24-0.44
# there, so a tolerance that admits it would admit a bug worth most of a nat (a leaked segment on the tiny test
# model moves log-probs by 0.04).
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
# Whether the self-check also asks the cost model (`forward_flops`) and falls back where the packed forward would cost
# more than the plain one. bench/grpo_prefix.py's `packed` arm turns it off, to time what it turns down.
COST_MODEL = True


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


def check_dtype(model) -> torch.dtype:
    """The dtype the self-check computes in: float64 for a float64 model, else float32 (TOLERANCE)."""
    return torch.float64 if any(p.dtype == torch.float64 for p in model.parameters()) else torch.float32


@contextlib.contextmanager
def computing_in(model, accelerator, dtype: torch.dtype):
    """`model`'s forwards in `dtype` inside the block, whatever the run's precision: its floating weights and buffers
    cast in place (and back after it: bfloat16 or float16 -> float32 -> back is exact, and each tensor keeps its
    identity, so the optimizer's references hold), autocast off (accelerate's `autocast()` handler, and the autocast
    a prepared model's forward is wrapped in: accelerate keeps the unwrapped forward as `_original_forward`), and
    float32 matmuls in full precision (no TF32 on a GPU). Holds a float32 copy of the weights meanwhile."""
    from accelerate.utils import AutocastKwargs

    cast = [(t, t.dtype) for t in itertools.chain(model.parameters(), model.buffers())
            if t.is_floating_point() and t.dtype != dtype]
    handler, forward = accelerator.autocast_handler, model.__dict__.get("forward")
    wrapped = "_original_forward" in model.__dict__ and forward is not None
    precision = torch.get_float32_matmul_precision()
    try:
        for t, _ in cast:
            t.data = t.data.to(dtype)
        accelerator.autocast_handler = AutocastKwargs(enabled=False)
        if wrapped:
            model.forward = model._original_forward
        torch.set_float32_matmul_precision("highest")
        with torch.autocast(accelerator.device.type, enabled=False):
            yield
    finally:
        torch.set_float32_matmul_precision(precision)
        if wrapped:
            model.forward = forward
        accelerator.autocast_handler = handler
        for t, original in cast:
            t.data = t.data.to(original)


def trainer_class(trainer_cls, on_state=None):
    """`trainer_cls` (GRPOTrainer, or a partial of slmsql's subclasses) computing every per-token log-prob with the
    shared prefix, after a self-check against the plain path on the first generation batch's first micro-batch
    (TRL's path until then, and from then on if it fails: module docstring). `on_state(text)` hears what the run
    does (on, with the check's figure; or the plain path, and why) for the run's tag."""
    if isinstance(trainer_cls, functools.partial):
        return functools.partial(trainer_class(trainer_cls.func, on_state), *trainer_cls.args, **trainer_cls.keywords)

    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.grpo_trainer import (
        shuffle_sequence_dict,
        split_pixel_values_by_grid,
        split_tensor_dict,
        unsplit_pixel_values_by_grid,
    )

    class SharedPrefixTrainer(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._shared_prefix, self._cost_ratio = "unchecked", None
            impl = attention_implementation(self.model)
            if impl not in MASKED_ATTENTION:
                self._plain(f"attention implementation {impl} takes no custom 4-D mask (shared prefix needs one of "
                            f"{', '.join(MASKED_ATTENTION)})")
            elif why := partial_attention(self.model):
                self._plain(why)

        def _plain(self, why: str) -> None:
            self._shared_prefix = "off"
            log.warning("shared prefix off, the plain path from here on: %s", why)
            if on_state:
                on_state(f"plain path: {why}")

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            # transformers' generate, each prompt prefilled once (`generate`), once the check has passed: until then
            # and after a fallback, TRL's own; vLLM shares prefill itself (n = K)
            model = self.accelerator.unwrap_model(self.model)
            if self._shared_prefix != "on" or self.use_vllm or self.use_transformers_continuous_batching \
                    or images is not None or multimodal_fields:
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                     has_tool_images)
            model.generate = functools.partial(generate, model.generate, model)
            try:
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                     has_tool_images)
            finally:
                del model.generate

        def _prepare_inputs(self, generation_batch):
            # TRL 1.16's own, with the self-check on the first generation batch before it is shuffled, and then
            # micro-batches that hold whole groups (shuffle_groups); off, exactly TRL's
            if not self.model.training or self._shared_prefix == "off":
                return super()._prepare_inputs(generation_batch)
            generate_every = self.args.steps_per_generation * self.num_iterations
            if self._step % generate_every == 0 or self._buffered_inputs is None:
                batch = self._generate_and_score_completions(generation_batch)
                if self._shared_prefix == "unchecked":
                    self._self_check(batch)
                batch = split_pixel_values_by_grid(batch)
                shuffled = shuffle_groups(batch, self.num_generations) if self._shared_prefix == "on" else None
                batch = shuffled or shuffle_sequence_dict(batch)
                self._buffered_inputs = [unsplit_pixel_values_by_grid(b)
                                         for b in split_tensor_dict(batch, self.args.steps_per_generation)]
            return self._buffered_inputs[self._step % self.args.steps_per_generation]

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                               **extra):
            plain = functools.partial(super()._get_per_token_logps_and_entropies, model, input_ids, attention_mask,
                                      logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **extra)
            # until the check has passed (the first generation's old and reference log-probs) and after a fallback,
            # TRL's own
            if self._shared_prefix != "on" or compute_aux_loss or any(v is not None for v in extra.values()):
                return plain()
            logps, entropies = self._shared(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                            compute_entropy)
            return logps, entropies, None

        def _shared(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy):
            parts, rows, computed = [], [], 0
            for chunk in chunks(input_ids, attention_mask, logits_to_keep, batch_size or input_ids.size(0)):
                index = torch.tensor(chunk, device=input_ids.device)
                ids, mask = input_ids[index], attention_mask[index]
                packing = Packing.of(ids, mask, logits_to_keep, self._tokenizer.pad_token_id or 0)
                with self.accelerator.autocast():
                    if packing is None:  # not TRL's prompt | completion layout: this chunk the plain way
                        lp, ent, _ = super()._get_per_token_logps_and_entropies(
                            model, ids, mask, logits_to_keep, compute_entropy=compute_entropy)
                        computed += ids.numel()
                    else:
                        lp, ent = packed_logps(model, packing, compute_entropy)
                        computed += packing.tokens
                parts.append((lp, ent))
                rows += chunk
            if model.training and torch.is_grad_enabled():
                self._metrics["train"]["shared_prefix/token_ratio"].append(input_ids.numel() / max(computed, 1))
            back = torch.argsort(torch.tensor(rows, device=input_ids.device))
            logps = torch.cat([p[0] for p in parts])[back]
            entropies = torch.cat([p[1] for p in parts])[back] if compute_entropy else None
            return logps, entropies

        def _self_check(self, batch):
            """The first micro-batch of the first generation batch (per_device_train_batch_size rows, what one
            forward of the loss sees) both ways, in float32 whatever the run computes in (`computing_in`), dropout
            off: the largest |log p| difference over its completion tokens, the same on every process (the largest
            of them), logged; over TOLERANCE, the plain path from here on."""
            if any(batch.get(k) is not None for k in MULTIMODAL):
                self._plain("multimodal inputs (the packed layout is text-only)")
                return
            rows = slice(0, self.args.per_device_train_batch_size)
            input_ids = torch.cat([batch["prompt_ids"][rows], batch["completion_ids"][rows]], dim=1)
            attention_mask = torch.cat([batch["prompt_mask"][rows], batch["completion_mask"][rows]], dim=1)
            logits_to_keep = batch["completion_ids"].size(1)
            model = self.accelerator.unwrap_model(self.model)  # no DDP wrapper: nothing here is synchronised
            packing = Packing.of(input_ids, attention_mask, logits_to_keep, self._tokenizer.pad_token_id or 0)
            if packing is None:
                self._plain("the first micro-batch is not TRL's (left-padded prompt | right-padded completion) layout")
                return
            # the cost model, summed over every process so that all decide alike
            costs = self.accelerator.gather(torch.tensor(
                [forward_costs(input_ids, attention_mask, packing, cost_dims(model))], dtype=torch.float64,
                device=input_ids.device)).sum(0).tolist()
            self._cost_ratio = costs[0] / costs[1]
            self._metrics["train"]["shared_prefix/cost_ratio"].append(self._cost_ratio)
            if COST_MODEL and self._cost_ratio <= 1:
                self._plain(f"the cost model puts the packed forward at {1 / self._cost_ratio:.2f}x the plain path's "
                            f"FLOPs on the first micro-batch ({input_ids.size(0)} rows of {input_ids.size(1)} tokens "
                            f"-> {packing.input_ids.size(0)} packed rows of {packing.input_ids.size(1)}): attention "
                            "over the long packed rows costs more than the repeated prompts it saves")
                return
            dtype = check_dtype(model)
            was_training = model.training
            model.eval()  # dropout off: both computations see the same weights
            try:
                with torch.no_grad(), disable_gradient_checkpointing(model, self.args.gradient_checkpointing_kwargs), \
                        computing_in(model, self.accelerator, dtype):
                    plain, _, _ = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask,
                                                                            logits_to_keep)
                    shared, _ = self._shared(model, input_ids, attention_mask, logits_to_keep, None, False)
            finally:
                model.train(was_training)
            scored = attention_mask[:, -logits_to_keep:].bool()
            diff = (plain - shared).abs()[scored].max() if scored.any() else plain.new_zeros(())
            diff = float(self.accelerator.gather(diff.float().reshape(1)).max())
            self._metrics["train"]["shared_prefix/logp_max_abs_diff"].append(diff)
            tolerance, name = TOLERANCE[dtype], str(dtype).removeprefix("torch.")
            if not diff <= tolerance:  # NaN included
                self._plain(f"the first step's self-check found log-probs {diff:.3g} apart in {name} (tolerance "
                            f"{tolerance:g})")
                return
            self._shared_prefix = "on"
            if on_state:
                on_state(f"on: log-probs within {diff:.2g} of the plain path in {name} at the first step "
                         f"(tolerance {tolerance:g}); the packed forward at {1 / self._cost_ratio:.2f}x the plain "
                         "path's FLOPs there (cost model)")

    return SharedPrefixTrainer
