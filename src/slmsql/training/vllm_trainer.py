"""`slmsql grpo --backend vllm`'s trainer: TRL's GRPOTrainer (or slmsql's subclasses of it) generating every
rollout through slmsql.generation.vllm_rollouts' `Rollouts` (one vLLM engine serving the LoRA of each step; that
module's docstring says how TRL measures and corrects them). `trainer_for` builds it for a stage config.
"""

from __future__ import annotations

import functools
from pathlib import Path

from slmsql.generation.vllm_rollouts import Rollouts, engine_base


def trainer_for(cfg, trainer_cls, work: Path, model, tokenizer, longest: int):
    """`trainer_cls` as it is (--backend transformers), or generating through a vLLM engine (`model`: the policy's
    base as the stage loaded it; `longest`: its longest prompt in tokens)."""
    if cfg.backend != "vllm":
        return trainer_cls
    stacked = cfg.base_adapter and cfg.adapter_mode == "stack"  # the stage loaded that merge: saved as it is
    base = engine_base(cfg, work, *((model, tokenizer) if stacked else ()))
    return trainer_class(trainer_cls, Rollouts(cfg, base, longest, tokenizer, work))


def trainer_class(trainer_cls, rollouts: Rollouts):
    """`trainer_cls` (GRPOTrainer, or grpo_variants' partial of its subclass) generating through `rollouts`."""
    if isinstance(trainer_cls, functools.partial):
        return functools.partial(trainer_class(trainer_cls.func, rollouts), *trainer_cls.args,
                                 **trainer_cls.keywords)

    class VllmRolloutTrainer(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, rollout_func=rollouts, **kwargs)
            # after TRL's init, which would build its own engine for args.use_vllm: from here on TRL syncs,
            # measures and corrects these rollouts as it does its own vLLM's (vllm_rollouts' docstring)
            self.use_vllm, self._last_loaded_step = True, -1
            self.vllm_generation = rollouts.bind(self)

        def train(self, *args, **kwargs):
            try:
                return super().train(*args, **kwargs)
            finally:  # at the end of training, or a crash: the engine is not kept for the trainer's lifetime
                rollouts.close()

    return VllmRolloutTrainer
