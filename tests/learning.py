"""Did a GRPO run change the model? One check, reusable for every GRPO option (advantage gates, dynamic sampling...).

`assert_learned(out, run_id, model, prompt, start=None)` asserts, for the adapter a run saved under `out/adapter`:
- weights: some LoRA B matrix is non-zero (PEFT initialises a new LoRA's B to zero, so an all-zero B means no
  optimizer step reached it); when training continued the `start` adapter, some tensor differs from `start`'s;
- gradient: `grad_norm` > 0 at some step of the MLflow run (an all-zero gradient means no signal reached the loss);
- behaviour: the adapted model's next-token logits on `prompt`, loaded the way evaluation loads it
  (`models.load_model(model, adapter)`), differ from the starting policy's (`model`, plus `start` when given:
  the adapter a `--base-adapter` run started from, continued or stacked on).
It returns the measured figures, so a test can also state how much changed.

Usage, for a new option: run `grpo.main(cfg)` for a couple of steps on the fixture policy with the option on, then
`assert_learned(cfg.output_dir, run_id, cfg.model, prompt_for(cfg))`.
"""

from __future__ import annotations

from pathlib import Path

import torch

TOL = 1e-4  # merging an adapter into float32 weights moves logits by ~3e-6 (measured); 2 real steps, by far more


def adapter_weights(adapter) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(Path(adapter) / "adapter_model.safetensors")


def weight_change(adapter, start=None) -> float:
    """Largest absolute change of the adapter's tensors: vs `start`'s (same keys), or of its B matrices vs zero."""
    after = adapter_weights(adapter)
    if start is None:
        return max(float(v.abs().max()) for k, v in after.items() if "lora_B" in k)
    before = adapter_weights(start)
    assert before.keys() == after.keys(), "not the start adapter trained further (its keys changed)"
    return max(float((after[k] - before[k]).abs().max()) for k in after)


def grad_norms(run_id: str, client=None) -> list[float]:
    import mlflow

    history = (client or mlflow.MlflowClient()).get_metric_history(run_id, "grad_norm")
    return [h.value for h in sorted(history, key=lambda h: h.step)]


def prompt_for(cfg) -> str:
    """A fixed prompt: the run's first training question, rendered as the stage renders it."""
    from transformers import AutoTokenizer

    from slmsql.inputs.data import read_gold
    from slmsql.inputs.prompts import builder_for, render_prompt

    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    return render_prompt(tokenizer, builder_for(cfg).messages(read_gold(cfg.data)[0]))


@torch.no_grad()
def logits(model, adapter, prompt: str) -> torch.Tensor:
    """Next-token logits on `prompt` of `model` with `adapter`, loaded as evaluate and filter load it."""
    from slmsql.policy.models import load_model

    lm, tokenizer = load_model(model, adapter, device="cpu", dtype="float32")
    return lm(**tokenizer(prompt, return_tensors="pt")).logits[0, -1]


def assert_learned(out, run_id: str, model, prompt: str, start=None, continued=False, client=None) -> dict:
    """The checks in the module docstring on the adapter under `out/adapter` of run `run_id` (in `client`'s
    store, default: the current one). `continued`: the run trained `start` further (--adapter-mode continue)."""
    adapter = Path(out) / "adapter"
    figures = {"weight_change": weight_change(adapter, start if continued else None),
               "grad_norms": grad_norms(run_id, client),
               "logit_change": float((logits(model, adapter, prompt) - logits(model, start, prompt)).abs().max())}
    assert figures["grad_norms"], "the run logged no grad_norm"
    assert figures["weight_change"] > 0, f"the adapter did not change: {figures}"
    assert max(figures["grad_norms"]) > 0, f"zero gradient at every step: {figures}"
    assert figures["logit_change"] > TOL, f"the adapted model computes what the starting point computes: {figures}"
    return figures
