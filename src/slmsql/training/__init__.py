"""Training with TRL: the trainer's config, callbacks and telemetry (`hf_trainer`), the GRPO loss variants
(`grpo_variants`), and GRPOTrainer subclasses that compute with the shared prefix (`shared_prefix_trainer`) and
roll out from slmsql's vLLM engine (`vllm_trainer`). Uses `generation` and everything below it.
"""
