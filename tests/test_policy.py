"""The one `Policy` a stage resolves from its config (policy/resolve.py): every check that reads no weights, made
once before any weights load, and what the stage then hands on (load, params, tags, the records beside a saved
policy), on a tiny untrained model built here (seconds) that records the prompt settings it was "trained" on."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
from policy import foreign_adapter

from slmsql import configs
from slmsql.checks import promptcheck
from slmsql.errors import SlmsqlError
from slmsql.policy import models
from slmsql.policy.resolve import Policy
from slmsql.toy.tiny_model import build_tiny_model


@pytest.fixture(scope="module", name="tiny")
def tiny_policy(tmp_path_factory):
    """A tiny model folder whose records say which prompts it was trained on (as an SFT output's do)."""
    from types import SimpleNamespace

    root = tmp_path_factory.mktemp("policy-resolve")
    model = build_tiny_model(root / "m", ["How many items?", "SELECT count(*) FROM item"], vocab_size=300,
                             hidden=16, layers=1, heads=2, ffn=32)
    tiny = SimpleNamespace(model=model, source=root / "none.jsonl", db_root=root)
    promptcheck.record(model, promptcheck.settings(_cfg(tiny), models.load_tokenizer(model)))
    return tiny


def _cfg(tiny, **over):
    return configs.load(configs.FilterConfig, None, {"data": str(tiny.source), "db_root": str(tiny.db_root),
                                                      "model": str(tiny.model), **over})


@pytest.fixture
def no_weights(monkeypatch):
    """Resolving must read no weights: any load fails the test."""
    import transformers

    def refuse(*a, **k):
        pytest.fail("weights loaded while resolving a policy")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def test_resolve_reads_no_weights_and_states_the_policy(tiny, no_weights):
    cfg = _cfg(tiny)
    p = Policy.resolve(cfg)
    assert (p.model, p.adapter, p.dtype, p.folder) == (str(tiny.model), None, "float32", tiny.model)
    assert p.tokenizer.chat_template
    # the prompt settings are the ones recorded beside this policy
    assert p.prompt == promptcheck.recorded(tiny.model) == promptcheck.settings(cfg, p.tokenizer)
    assert p.params() == promptcheck.params(p.prompt) and set(p.params()) == {
        "prompt.system_prompt", "prompt.schema_source", "prompt.chat_template"}
    assert p.tags() == {"slmsql.model": str(tiny.model), "slmsql.adapter": ""}
    assert p.tags("slmsql.base_adapter")["slmsql.base_adapter"] == ""


@pytest.fixture
def foreign(tmp_path):
    return foreign_adapter(tmp_path)


def test_an_adapter_of_another_base_is_refused_before_any_weights_load(tiny, foreign, no_weights):
    with pytest.raises(SlmsqlError, match="was trained on base model"):
        Policy.resolve(_cfg(tiny), foreign)


def test_other_prompts_than_the_policy_was_trained_on_are_refused_unless_allowed(tiny, no_weights, caplog):
    other = _cfg(tiny, prompt_style="omnisql" if promptcheck.recorded(tiny.model)["prompt_style"] != "omnisql"
                 else "compact")
    with pytest.raises(SlmsqlError, match="trained on other prompts"):
        Policy.resolve(other)
    with caplog.at_level(logging.WARNING):
        p = Policy.resolve(dataclasses.replace(other, allow_prompt_change=True))
    assert "--allow-prompt-change" in caplog.text and p.prompt["prompt_style"] == other.prompt_style


def test_an_answer_start_is_another_prompt_for_a_policy_trained_on_whole_answers(tiny, no_weights, caplog):
    """evaluate's answer_prefix: a record without one says the policy wrote its whole answer in training."""
    primed = configs.load(configs.EvaluateConfig, None, {"data": str(tiny.source), "db_root": str(tiny.db_root),
                                                         "model": str(tiny.model), "answer_prefix": "```sql\n"})
    with pytest.raises(SlmsqlError, match=r"answer_prefix: trained '', now '```sql\\n'"):
        Policy.resolve(primed)
    with caplog.at_level(logging.WARNING):
        p = Policy.resolve(dataclasses.replace(primed, allow_prompt_change=True))
    assert p.prompt["answer_prefix"] == "```sql\n" and "prompt.answer_prefix" not in p.params()
    assert "answer_prefix" not in Policy.resolve(dataclasses.replace(primed, answer_prefix="")).prompt


def test_the_dtype_resolves_here_only_when_the_weights_load_here(tiny, no_weights):
    with pytest.raises(SlmsqlError, match="float16 needs a GPU"):
        Policy.resolve(_cfg(tiny, dtype="float16"))
    # a Ray engine's actors resolve it on their own device: the driver keeps the config's value
    assert Policy.resolve(_cfg(tiny, dtype="float16"), local=False).dtype == "float16"


def test_records_beside_a_policy_trained_from_it_make_it_load_as_trained(tiny, tmp_path):
    """An adapter trained on top of this policy's adapter (stack mode): the saved folder carries the prompt
    settings and a copy of the adapter beneath, which loading merges first."""
    from peft import LoraConfig, get_peft_model

    lm, _ = models.load_model(tiny.model, trainable=True)
    get_peft_model(lm, LoraConfig(r=2, target_modules="all-linear", task_type="CAUSAL_LM",
                                  init_lora_weights=False)).save_pretrained(tmp_path / "sft-adapter")
    p = Policy.resolve(_cfg(tiny), tmp_path / "sft-adapter")
    (tmp_path / "new").mkdir()
    p.record(tmp_path / "new", merged=True)
    assert json.loads((tmp_path / "new" / promptcheck.RECORD).read_text()) == p.prompt
    assert models.stacked_on(tmp_path / "new") == tmp_path / "new" / models.STACK_BASE
    # continuing a plain adapter: nothing lies beneath it, only the prompt settings are written
    (tmp_path / "continued").mkdir()
    p.record(tmp_path / "continued", merged=False)
    assert sorted(f.name for f in (tmp_path / "continued").iterdir()) == [promptcheck.RECORD]

    model, tokenizer = p.load()
    reference, _ = models.load_model(tiny.model, tmp_path / "sft-adapter")
    ids = tokenizer("SELECT name FROM item", return_tensors="pt")
    assert not model.training and str(model.dtype) == "torch.float32"
    assert (model(**ids).logits == reference(**ids).logits).all()  # the same weights, the same adapter on top
