"""Sampling from a policy: the filter's and evaluation's engines (`engines`), transformers sampling with one
prefill per prompt (`sampling`), the shared-prefix forward and prefill (`shared_prefix`), each schema computed
once across the questions of a call (`shared_schema`), GRPO rollouts from
merged LoRA weights (`merged_rollouts`), and vLLM: the engine (`vllm_engine`), its memory sizing (`vllm_memory`)
and GRPO's rollouts (`vllm_rollouts`).
Uses everything below `policy`, and `policy`.
"""
