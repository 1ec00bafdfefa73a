"""Merged rollouts: GRPO's transformers rollouts sampled with the LoRA merged into the base weights, restored after.

Why: on a CPU, generation is the larger part of a GRPO step at the SmolLM2 study's shape, and in every decode step
each LoRA layer adds two small matmuls (x A, then B) and their overhead to its base matmul: with all-linear, seven a
decoder layer. Merged, each is one matmul with W + s BA, as TRL merges before it loads weights into vLLM.

Exact for training: the merge never writes a base tensor. PEFT's safe merge computes W + s BA into a new tensor and
points the layer's weight at it; after the rollout every base weight (and bias) is pointed back at the tensor it
held, whose storage nothing wrote, and the layer is marked unmerged. So the weights the loss sees are the ones before,
bit for bit. (PEFT's unmerge, W + s BA - s BA, is not the identity in floats.)

What differs is sampling's float error: x (W + s BA) rounds at other points than x W + s (x A) B, so the logits
differ by ~1e-6 in float32 and a draw at an edge of the cumulative distribution may go to the other token. The
first rollout with a non-zero LoRA measures it (`gap`: the largest |log p| difference between the merged forward and
the training one on the sampled completions; a fresh LoRA's B starts at zero, and W + 0 is W, so its first rollout
is the next step's), logs it as `rollout/merged_logprob_gap` and in the run's tag; over TOLERANCE the run stops.
Half-precision weights are refused: W + s BA rounded to bfloat16's 8 bits drops most of a young LoRA's update, so the
rollouts would come from another policy.

Dropout: TRL generates on its transformers path with the model in training mode; slmsql's GRPO always sets TRL's
`disable_dropout` (stages/grpo.py), so the unmerged LoRA's dropout has p = 0 and both ways sample the same policy.
A LoRA dropout still on in training mode is refused (the merged weights cannot draw its masks).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from slmsql.errors import SlmsqlError

log = logging.getLogger(__name__)

TAG = "slmsql.merged_rollouts"  # a run's tag: the first rollout's log-prob gap, merged vs the training forward
METRIC = "rollout/merged_logprob_gap"
# The largest gap the first rollout accepts. float32's is float error (~1e-6 on the tiny models, tests); a wrong
# merge (a scaling off by 2) moves log-probs by tenths to units.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}


def check(cfg) -> None:
    """Refuse, before a model loads, what merged rollouts cannot apply to (cfg: a GRPOStageConfig)."""
    if not cfg.merged_rollouts:
        return
    why = None
    if not (cfg.use_lora or (cfg.base_adapter and cfg.adapter_mode == "continue")):
        why = "the policy trains without a LoRA (use_lora false): there is nothing to merge"
    elif cfg.backend == "vllm" or cfg.trainer_args.get("use_vllm"):
        why = "vLLM generates the rollouts (it serves the LoRA its own way)"
    elif cfg.trainer_args.get("use_transformers_continuous_batching"):
        why = "TRL's continuous batching casts the model for its rollouts"
    elif cfg.dtype in ("bfloat16", "float16"):
        why = f"{cfg.dtype} weights would round the merged LoRA's update away (float32 only)"
    if why:
        raise SlmsqlError(f"merged_rollouts: {why}; set merged_rollouts false")


def lora_layers(model) -> list:
    """The model's LoRA layers; refused unless each is a LoRA on a linear layer with plain float32/64 weights."""
    from peft.tuners.lora import Linear, LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    if not layers:
        raise SlmsqlError("merged_rollouts: the model has no LoRA layer to merge; set merged_rollouts false")
    for layer in layers:
        weight = layer.get_base_layer().weight
        # an embedding's LoRA would merge into a weight the LM head may share; quantized weights are not plain
        if not isinstance(layer, Linear) or type(weight) is not torch.nn.Parameter or weight.dtype not in TOLERANCE:
            raise SlmsqlError(f"merged_rollouts: {type(layer).__name__} on {type(weight).__name__} of {weight.dtype} "
                              "cannot be merged exactly (a LoRA on linear layers of float32 weights only); set "
                              "merged_rollouts false")
    return layers


@contextlib.contextmanager
def merged(model, layers=None):
    """`model` with its active LoRA merged into new base tensors; on exit every base tensor is the one before."""
    layers = lora_layers(model) if layers is None else layers
    for layer in layers:
        dropout = [d.p for d in layer.lora_dropout.values() if isinstance(d, torch.nn.Dropout)]
        if layer.training and any(dropout):
            raise SlmsqlError(f"merged_rollouts: the LoRA's dropout is on (p {max(dropout)}) in training mode and the "
                              "merged weights cannot draw its masks: train with disable_dropout (slmsql's GRPO does)")
    saved = [(p, p.data) for layer in layers for p in layer.get_base_layer().parameters(recurse=False)]
    try:
        with torch.no_grad():
            for layer in layers:
                layer.merge(safe_merge=True)  # W + s BA into a new tensor: the base tensor is not written
        yield model
    finally:
        for param, data in saved:
            param.data = data
        for layer in layers:
            layer.merged_adapters.clear()  # PEFT's record of the merge; unmerge() would subtract, needlessly


def completion_logps(model, prompts: list[list[int]], completions: list[list[int]], temperature: float) -> list:
    """Per completion, the log-probs of its tokens at `temperature` (one row at a time: no padding, bounded logits)."""
    device = next(model.parameters()).device
    out = []
    for prompt, completion in zip(prompts, completions):
        if not completion:
            continue
        ids = torch.tensor([list(prompt) + list(completion)], device=device)
        logits = model(input_ids=ids, logits_to_keep=len(completion) + 1, use_cache=False).logits[0, :-1]
        logps = torch.log_softmax(logits.float() / temperature, dim=-1)
        out.append(logps.gather(-1, ids[0, -len(completion):, None]).squeeze(-1))
    return out


def gap(model, prompts, completions, temperature: float, layers=None) -> float:
    """The largest |log p merged - log p unmerged| over the completions' tokens, dropout off (eval mode)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            plain = completion_logps(model, prompts, completions, temperature)
            with merged(model, layers):
                fused = completion_logps(model, prompts, completions, temperature)
    finally:
        model.train(was_training)
    return max((float((a - b).abs().max()) for a, b in zip(plain, fused)), default=0.0)
