"""GRPO's trainer with merged rollouts (`slmsql grpo --merged-rollouts`): TRL's GRPOTrainer (or slmsql's subclasses
of it) whose transformers rollouts are sampled with the LoRA merged into the base weights, restored after
(slmsql.generation.merged_rollouts: the merge, its exactness for training and the log-prob gap it measures).
"""

from __future__ import annotations

import functools

import torch

from slmsql.errors import SlmsqlError
from slmsql.generation.merged_rollouts import METRIC, TOLERANCE, gap, lora_layers, merged


def trainer_class(trainer_cls, on_state=None):
    """`trainer_cls` (GRPOTrainer, a subclass or a partial of one) whose transformers rollouts are sampled merged;
    the first non-zero LoRA's gap is logged, told to `on_state(text)` (the run's tag) and held to TOLERANCE."""
    if isinstance(trainer_cls, functools.partial):
        return functools.partial(trainer_class(trainer_cls.func, on_state), *trainer_cls.args, **trainer_cls.keywords)

    class MergedRolloutsTrainer(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._merged_layers = lora_layers(self.accelerator.unwrap_model(self.model))  # refused here, not later
            self._merged_gap = None
            if on_state:
                on_state("on: rollouts sampled with the LoRA merged (log-prob gap measured at the first rollout with a "
                         "non-zero LoRA)")

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            generate = functools.partial(super()._generate_single_turn, prompt_ids, images, multimodal_fields,
                                         num_generations, has_tool_images)
            if self.use_vllm or self.use_transformers_continuous_batching:  # check() refuses them for slmsql's runs
                return generate()
            model = self.accelerator.unwrap_model(self.model)
            with merged(model, self._merged_layers):
                completion_ids, logprobs = generate()
            if self._merged_gap is None and any(bool(b.weight.any()) for layer in self._merged_layers
                                                for b in layer.lora_B.values()):  # every process alike
                self._first_gap(model, prompt_ids, completion_ids)
            return completion_ids, logprobs

        def _first_gap(self, model, prompt_ids, completion_ids):
            value = gap(model, prompt_ids, completion_ids, self.temperature, self._merged_layers)
            value = float(self.accelerator.gather(torch.tensor([value], device=self.accelerator.device)).max())
            self._merged_gap = value
            self._metrics["train"][METRIC].append(value)
            dtype = self._merged_layers[0].get_base_layer().weight.dtype
            tolerance, name = TOLERANCE[dtype], str(dtype).removeprefix("torch.")
            if not value <= tolerance:  # NaN included
                if on_state:
                    on_state(f"stopped: log-probs {value:.3g} apart (tolerance {tolerance:g})")
                raise SlmsqlError(f"merged_rollouts: the merged policy's log-probs are {value:.3g} from the training "
                                  f"forward's on the sampled completions (tolerance {tolerance:g} in {name}): the merge "
                                  "is not the policy; set merged_rollouts false")
            if on_state:
                on_state(f"on: rollouts sampled with the LoRA merged, log-probs within {value:.2g} of the training "
                         f"forward (tolerance {tolerance:g} in {name})")

    return MergedRolloutsTrainer
