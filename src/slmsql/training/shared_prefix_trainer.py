"""Shared-prefix GRPO in TRL's GRPOTrainer: `trainer_class` computes every per-token log-prob TRL takes through
slmsql.generation.shared_prefix's packed layout (one method, `_get_per_token_logps_and_entropies`: the policy's in
the loss, the old policy's, the reference model's), prefills each prompt once in generation, and shuffles a
generation batch by whole groups.

Nothing changes TRL's path before the self-check has passed: the first generation batch is generated, scored and
(where TRL takes them) its old and reference log-probs computed TRL's way; then its first micro-batch is checked,
and only then is it shuffled, by groups when the check passed and by rows (TRL's) when it did not. The check asks
the cost model first (is packing cheaper on this micro-batch?), then computes the micro-batch both ways in float32
(`computing_in`). A run that falls back, at its start (an attention the packed mask cannot reach) or at the check,
is TRL's own path from its first step to its last: the same micro-batches in the same order and the same generate
calls. Each checkpoint keeps the check's verdict (VERDICT), so a resumed run goes on as the run it resumes: checked
again at its own first batch, its first generation's old log-probs (taken under vLLM) would be TRL's, not packed.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
from pathlib import Path

import torch

from slmsql.generation.shared_prefix import (
    MASKED_ATTENTION,
    Packing,
    attention_implementation,
    chunks,
    cost_dims,
    forward_costs,
    generate,
    packed_logps,
    partial_attention,
    shuffle_groups,
)

log = logging.getLogger(__name__)

TAG = "slmsql.shared_prefix"  # a run's tag: what --shared-prefix did (on, with the self-check's figure; or why not)
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
# Whether the self-check also asks the cost model (generation.shared_prefix.forward_flops) and falls back where the
# packed forward would cost more than the plain one. bench/grpo_prefix.py's `packed` arm turns it off, to time what it
# turns down.
COST_MODEL = True
VERDICT = "shared_prefix.json"  # in each checkpoint folder: the self-check's verdict ("on" or "off") and cost ratio


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

        def _save_checkpoint(self, model, trial):
            super()._save_checkpoint(model, trial)
            if self.args.should_save:
                folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
                (folder / VERDICT).write_text(json.dumps({"state": self._shared_prefix,
                                                          "cost_ratio": self._cost_ratio}))

        def train(self, resume_from_checkpoint=None, *args, **kwargs):
            # a resumed run takes its checkpoint's verdict instead of checking again (one made before the verdict was
            # kept is checked again); a fallback found at this start (the attention) stands whatever it says
            if resume_from_checkpoint is True:
                from transformers.trainer_utils import get_last_checkpoint
                resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            kept = Path(resume_from_checkpoint) / VERDICT if resume_from_checkpoint else None
            if kept and kept.is_file() and self._shared_prefix == "unchecked":
                verdict = json.loads(kept.read_text())
                self._shared_prefix, self._cost_ratio = verdict["state"], verdict["cost_ratio"]
                log.info("shared prefix %s, as the resumed run's self-check found (%s)", self._shared_prefix, kept)
            return super().train(resume_from_checkpoint, *args, **kwargs)

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
