"""One sampling distribution (issue 22, 4c): the filter's K samples and GRPO's rollouts apply slmsql's sampling
options (configs.Sampling), the same ones in the same order, and never what the checkpoint's
generation_config.json says. Read from what transformers actually applies: every logits-processor list that
`generate` builds during the filter's generation and GRPO's first rollout."""

from __future__ import annotations

import json

import pytest
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
from transformers.generation.utils import GenerationMixin

from slmsql import configs
from slmsql.generation import engines
from slmsql.inputs.data import read_gold
from slmsql.errors import DataError
from slmsql.generation.sampling import _RowSampler
from slmsql.policy.models import load_model
from slmsql.toy.tiny_model import build_tiny_model
from slmsql.stages import grpo

# A Qwen-instruct-like generation config: every value differs from slmsql's defaults and from the test's own.
CHECKPOINT = {"do_sample": True, "temperature": 0.6, "top_p": 0.8, "top_k": 20, "min_p": 0.1,
              "repetition_penalty": 1.05}
STEPS = {RepetitionPenaltyLogitsProcessor: ("repetition_penalty", "penalty", 1.0),
         TemperatureLogitsWarper: ("temperature", "temperature", 1.0), TopKLogitsWarper: ("top_k", "top_k", 0),
         TopPLogitsWarper: ("top_p", "top_p", 1.0), MinPLogitsWarper: ("min_p", "min_p", 0.0)}
QUESTIONS = [{"id": "q1", "db_id": "shop", "question": "How many items?", "sql": "SELECT count(*) FROM item"},
             {"id": "q2", "db_id": "shop", "question": "Name the cheapest item.",
              "sql": "SELECT name FROM item ORDER BY price LIMIT 1"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny model whose generation_config.json sets the checkpoint's own sampling values."""
    texts = [q["question"] + " " + q["sql"] for q in QUESTIONS] * 4 + ["CREATE TABLE item (id, name, price, kind)"]
    folder = build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", texts, vocab_size=300, hidden=32, layers=1,
                              heads=4, ffn=64)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **CHECKPOINT}))
    return folder


class _Rollout(Exception):
    """Raised by the spy at GRPO's first rollout: what it samples with is known, no need to train."""


@pytest.fixture
def processors(monkeypatch):
    """Every logits-processor list `generate` builds (the whole of what shapes the next-token distribution;
    with do_sample=False nothing else applies). `processors.stop = True`: raise _Rollout after recording."""
    seen, original = [], GenerationMixin._get_logits_processor

    def spy(self, *args, **kwargs):
        seen.append(original(self, *args, **kwargs))
        if spy.stop:
            raise _Rollout
        return seen[-1]

    spy.stop = False
    monkeypatch.setattr(GenerationMixin, "_get_logits_processor", spy)
    return seen, spy


def applied(steps) -> list[tuple[str, float]]:
    """The sampling steps a processor list applies, in order, as (setting, value); steps that change nothing
    (temperature 1, top_k 0, top_p 1, min_p 0, penalty 1) are left out, _RowSampler contributes its warpers.
    Any other processor fails the test: nothing else may shape the distribution."""
    out = []
    for step in steps:
        if isinstance(step, _RowSampler):
            out += applied(step.warpers)
            continue
        assert type(step) in STEPS, f"unexpected logits processor {type(step).__name__}"
        name, attr, noop = STEPS[type(step)]
        if getattr(step, attr) != noop:
            out.append((name, float(getattr(step, attr))))
    return out


def stage_args(tmp_path, shop, checkpoint, sampling):
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return {"data": str(data), "db_root": str(shop), "model": str(checkpoint), "workers": 1, **sampling}


@pytest.mark.parametrize("sampling, expected", [
    ({}, [("temperature", 0.8)]),  # slmsql's defaults: the checkpoint's top_k, top_p, min_p, penalty stay off
    ({"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3},
     [("repetition_penalty", 1.3), ("temperature", 0.7), ("top_k", 5.0), ("top_p", 0.9), ("min_p", 0.05)]),
], ids=["defaults", "set"])
def test_filter_and_grpo_sample_with_slmsql_values_not_the_checkpoints(sampling, expected, checkpoint, shop,
                                                                       tmp_path, processors):
    seen, spy = processors
    args = stage_args(tmp_path, shop, checkpoint, sampling)

    # the filter's generation, as its engines run it
    fcfg = configs.load(configs.FilterConfig, None, {**args, "k": 2, "max_new_tokens": 3,
                                                     "output_dir": str(tmp_path / "f")})
    engines.Work("filter", fcfg).generate(read_gold(fcfg.data), load_model(fcfg.model), progress=False)
    assert seen, "the filter did not generate"
    filter_steps = {tuple(applied(s)) for s in seen}

    # GRPO's first rollout, through the stage (slmsql config -> TRL GRPOConfig -> GRPOTrainer -> generate)
    seen.clear()
    spy.stop = True
    gcfg = configs.load(configs.GRPOStageConfig, None, {
        **args, "num_generations": 2, "per_device_train_batch_size": 2, "max_completion_length": 3,
        "max_steps": 1, "lora_r": 4, "lora_alpha": 8, "output_dir": str(tmp_path / "g")})
    with pytest.raises(_Rollout):
        grpo.main(gcfg)
    grpo_steps = {tuple(applied(s)) for s in seen}

    assert filter_steps == grpo_steps == {tuple(expected)}


def test_evaluate_is_greedy_whatever_the_checkpoint_says(checkpoint, shop, tmp_path, processors):
    seen, _ = processors
    args = stage_args(tmp_path, shop, checkpoint, {})
    cfg = configs.load(configs.EvaluateConfig, None, {**args, "max_new_tokens": 3})
    engines.Work("evaluate", cfg).generate(read_gold(cfg.data), load_model(cfg.model), progress=False)
    assert seen and all(applied(s) == [] for s in seen)


@pytest.mark.parametrize("field, value", [("temperature", 0), ("top_p", 1.5), ("top_k", -1), ("min_p", 2),
                                          ("repetition_penalty", 0)])
def test_bad_sampling_values_are_refused_naming_the_field(field, value):
    for cls in (configs.FilterConfig, configs.GRPOStageConfig):
        with pytest.raises(DataError, match=field):
            configs.load(cls, None, {field: value})
