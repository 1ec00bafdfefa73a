"""Training with TRL: the trainer's config, callbacks and telemetry (`hf_trainer`) and the GRPO loss variants
(`grpo_variants`). Uses `generation` and everything below it.
"""
