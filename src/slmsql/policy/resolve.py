"""One `Policy`, resolved once from a stage's config before any weights load.

A policy is a base model (a Hub id or a path) with an optional adapter on top, which may itself have been stacked
on others (models.py). Resolving it makes every check that reads no weights, once, in one order: the adapter was
trained on this base (and carries what it was stacked on), the dtype is one this machine can run, the tokenizer
loads and has a chat template, and the prompts this run would build are the ones the policy was trained on
(checks/promptcheck.py). Stages then hand the one object to generation, training and tracking: `load` for the
weights, `check_prompts` for the token budget, `params` and `tags` for the run, `record` beside a policy they save.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from slmsql.checks import promptcheck
from slmsql.inputs import tokens
from slmsql.policy import models


@dataclass(frozen=True)
class Policy:
    model: str  # the base, as the user named it (Hub id or path)
    adapter: str | None  # the adapter on top, or None
    dtype: str  # the precision it runs in here (float32, bfloat16...), or the config's when it loads elsewhere
    tokenizer: object = field(repr=False)
    prompt: dict = field(default_factory=dict)  # the prompt settings this run builds (promptcheck.settings)
    folder: Path | None = None  # where its records lie (its adapter's folder, or a local model's)
    provenance: dict = field(default_factory=dict)  # slmsql.model_provenance, when its files say where they came from

    @classmethod
    def resolve(cls, cfg, adapter: str | os.PathLike | None = None, *, local: bool = True) -> Policy:
        """`cfg.model` with `adapter` (a stage's --adapter or --base-adapter) on top, checked. `local`: the weights
        load in this process, so the dtype resolves on its device (a Ray engine's actors resolve their own)."""
        from slmsql.tracking.runs import provenance_tag

        adapter = str(adapter) if adapter else None
        if adapter:
            models.check_adapter_base(adapter, cfg.model)
        dtype = models.dtype_name(cfg.dtype) if local else str(cfg.dtype)
        tokenizer = models.load_tokenizer(cfg.model)
        folder = models.policy_folder(cfg.model, adapter)
        prompt = promptcheck.settings(cfg, tokenizer)
        promptcheck.check_trained_with(folder, prompt, cfg.allow_prompt_change)
        return cls(str(cfg.model), adapter, dtype, tokenizer, prompt, folder, provenance_tag(str(cfg.model)))

    def check_prompts(self, cfg, examples, *, new_tokens: int) -> dict:
        """The `tokens/*` metrics of the prompts this run builds for `examples`; refuses any that leaves fewer
        than `new_tokens` of the model's context."""
        return promptcheck.token_budget(cfg, examples, self.tokenizer, new_tokens=new_tokens)

    def check_answers(self, answers: list[str], *, new_tokens: int, source: str) -> dict:
        """The `tokens/answer_*` metrics of generated answers; warns when many reached the generation budget."""
        return tokens.answer_budget(self.tokenizer, answers, new_tokens=new_tokens, source=source)

    def load(self, *, trainable: bool = False, merge_adapter: bool = False):
        """(model, tokenizer): the weights, with the adapter stack applied (models.load_model)."""
        return models.load_model(self.model, self.adapter, dtype=self.dtype, trainable=trainable,
                                 merge_adapter=merge_adapter)

    def load_to_train(self, *, merge_adapter: bool = False):
        """(model, tokenizer) to train: the adapter trained further (or a plain model), or with `merge_adapter` the
        adapter merged into the base weights, all of them trainable, for a new adapter on top (stack mode)."""
        if not merge_adapter:
            return self.load(trainable=True)
        model, tokenizer = self.load(merge_adapter=True)
        model.requires_grad_(True)
        return model, tokenizer

    def params(self) -> dict:
        """The run's `prompt.*` params (the settings that are not config fields already)."""
        return promptcheck.params(self.prompt)

    def tags(self, adapter_tag: str = "slmsql.adapter") -> dict:
        """The run's tags naming it: the base, the adapter under `adapter_tag` (a training stage's adapter is the
        one it starts from: slmsql.base_adapter), and the provenance its files record."""
        from slmsql.tracking.runs import portable

        return {"slmsql.model": portable(self.model), adapter_tag: portable(self.adapter or ""), **self.provenance}

    def record(self, folder, *, merged: bool | None = None) -> None:
        """Beside a policy trained from this one and saved in `folder`: the prompt settings it was trained on and,
        when it was trained on top of this policy's adapter, that adapter (`merged`: into the base, stack mode;
        False: the adapter trained further), so it loads as trained."""
        if self.adapter and merged is not None:
            models.record_stack(folder, self.adapter, merged=merged)
        promptcheck.record(folder, self.prompt)
