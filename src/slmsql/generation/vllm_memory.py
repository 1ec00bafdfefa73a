"""Does GRPO's vLLM rollout engine (`grpo --backend vllm`) fit its share of the GPU? Checked before any model loads.

vLLM claims `gpu_memory_utilization` x the GPU's memory when it starts (TRL's colocate share,
`vllm_gpu_memory_utilization`, 0.3 by default) and, inside it, must hold the weights, the peak of its start-up
profiling (a forward over `max_num_batched_tokens` tokens and a sampler over `max_num_seqs` rows) and a KV cache;
when weights and profiling leave no room for the cache it fails after the policy has loaded, minutes into the
run. Here the same sum is estimated from the model's config.json (its parameters counted on torch's meta
device: no weight is read), the engine's sizes (vllm_engine.sizing) and one generation batch's KV cache, and the
run refused with the numbers when it does not fit. The figures are estimates, not vLLM's own profile: each term
is described where it is computed, and `RUNTIME` covers what no formula here sees (the CUDA context, cuBLAS
workspaces, CUDA graphs).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024 ** 3
RUNTIME = 1 * GIB  # CUDA context, library workspaces and CUDA graphs: outside the torch tensors counted below
BLOCK = 16  # vLLM's KV cache block on CUDA (tokens): a sample's last, partly filled block is its own


@dataclass(frozen=True)
class Estimate:
    """Bytes of each term against the engine's share of a GPU of `gpu` bytes."""

    weights: int
    lora: int
    activations: int
    kv_cache: int
    gpu: int
    utilization: float

    @property
    def total(self) -> int:
        return self.weights + self.lora + self.activations + self.kv_cache + RUNTIME

    @property
    def share(self) -> int:
        return int(self.utilization * self.gpu)

    def fits(self) -> bool:
        return self.total <= self.share

    def describe(self) -> str:
        g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        return (f"weights {g(self.weights)} + LoRA slots {g(self.lora)} + profiling activations "
                f"{g(self.activations)} + KV cache for one generation batch {g(self.kv_cache)} + runtime "
                f"{g(RUNTIME)} = {g(self.total)}, against gpu_memory_utilization {self.utilization} x "
                f"{g(self.gpu)} = {g(self.share)}")


def parameters(config) -> tuple[int, int]:
    """(parameters, LoRA slot elements per unit of rank) of the model `config` describes, counted on torch's meta
    device (shapes only): a slot is r x (in + out) for every linear layer in the decoder (vLLM reserves one for
    every layer it can adapt, whatever the adapter targets)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    total = sum(p.numel() for p in model.parameters())  # a tied head is one parameter, counted once
    per_rank = sum(m.in_features + m.out_features for m in model.modules()
                   if isinstance(m, torch.nn.Linear) and m is not head)
    return total, per_rank


def estimate(config, *, dtype_bytes: int, lora_rank: int, sizes: dict, prompts: int, samples: int, longest: int,
             new_tokens: int, gpu: int, utilization: float) -> Estimate:
    """The engine's memory for a model `config` (transformers config) in `dtype_bytes` per value, a LoRA of rank
    `lora_rank` (0: none), vLLM's sizes `sizes` (vllm_engine.sizing) and generation batches of `prompts` prompts x
    `samples` samples, prompts up to `longest` tokens, `new_tokens` per completion."""
    params, per_rank = parameters(config)
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    # profiling's forward: one layer's live tensors at its MLP, per token: the residual stream and its norm
    # (2 x hidden), gate and up projections (2 x intermediate) and their product (intermediate); then the
    # sampler's float32 logits over max_num_seqs rows, with its probabilities and log-probabilities beside them
    tokens = sizes["max_num_batched_tokens"]
    activations = tokens * (2 * hidden + 3 * inter) * dtype_bytes + 3 * sizes["max_num_seqs"] * config.vocab_size * 4
    # the KV cache one generation batch fills: each prompt once (its samples share its full blocks: prefix caching),
    # each sample's completion and its own last partial block
    per_token = config.num_hidden_layers * 2 * kv_heads * head_dim * dtype_bytes
    kv_tokens = prompts * longest + prompts * samples * (new_tokens + BLOCK)
    return Estimate(weights=params * dtype_bytes, lora=lora_rank * per_rank * dtype_bytes, activations=activations,
                    kv_cache=kv_tokens * per_token, gpu=gpu, utilization=utilization)
