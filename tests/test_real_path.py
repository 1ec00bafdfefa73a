"""The checks a real model needs before any model loads, on a tiny model built here (seconds):
token budgets (SFT truncation, prompts past the model's context), prompt settings recorded beside a policy and
compared by every stage that prompts it, `--tables-json`, and the pipeline's `--recipes` folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlflow
import pytest

from slmsql import configs
from slmsql.generation import sampling as generation
from slmsql.workflow import mlproject, steps as workflow
from slmsql.policy import models
from slmsql.toy.tiny_model import build_tiny_model
from slmsql.checks import promptcheck
from slmsql.inputs import tokens
from slmsql.inputs.data import read_gold
from slmsql.errors import DataError, SlmsqlError
from slmsql.stages import evaluate, filter as filter_stage, grpo, sft

QUESTIONS = ["How many items are there?", "What is the name of the cheapest item?",
             "List the names of the items of kind office, from the most expensive to the cheapest one, please."]
SQL = ["SELECT count(*) FROM item", "SELECT name FROM item ORDER BY price LIMIT 1",
       "SELECT name FROM item WHERE kind = 'office' ORDER BY price DESC"]


@pytest.fixture
def world(shop, tmp_path):
    """A gold file of 3 questions on the `shop` database and a tiny untrained model (context 2048)."""
    gold = tmp_path / "gold.jsonl"
    gold.write_text("".join(json.dumps({"id": str(i), "db_id": "shop", "question": q, "sql": s}) + "\n"
                            for i, (q, s) in enumerate(zip(QUESTIONS, SQL))))
    model = build_tiny_model(tmp_path / "tiny", QUESTIONS + SQL, vocab_size=300, hidden=16, layers=1,
                                    heads=2, ffn=32)
    return gold, shop, model


@pytest.fixture
def no_model_loads(monkeypatch):
    """These checks must fail before any weights are read."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the check")
    monkeypatch.setattr(models, "load_model", refuse)


def sft_cfg(world, tmp_path, **extra):
    gold, db_root, model = world
    return configs.load(configs.SFTStageConfig, None, {"data": str(gold), "db_root": str(db_root),
                                                       "model": str(model), "output_dir": str(tmp_path / "out"),
                                                       **extra})


def lengths(world, cfg):
    tokenizer = models.load_tokenizer(world[2])
    return tokens.sft_lengths(tokenizer, sft.conversations(cfg, read_gold(world[0])))[1]


def test_sft_refuses_examples_max_length_would_truncate(world, tmp_path, no_model_loads):
    full = lengths(world, sft_cfg(world, tmp_path))
    longest = max(full)
    cfg = sft_cfg(world, tmp_path, max_length=longest - 1)
    with pytest.raises(SlmsqlError, match=rf"1 of 3 examples are longer than max_length={longest - 1}.*"
                                          rf"longest: '2', {longest} tokens"):
        sft.main(cfg)
    assert not (tmp_path / "out").exists() and not mlflow.search_runs(search_all_experiments=True).shape[0]


@pytest.mark.slow
def test_sft_drop_long_leaves_them_out_and_counts_them(world, tmp_path):
    full = lengths(world, sft_cfg(world, tmp_path))
    cfg = sft_cfg(world, tmp_path, max_length=max(full) - 1, drop_long=True, max_steps=1,
                  per_device_train_batch_size=2)
    summary = sft.main(cfg)
    assert summary["examples"] == 2
    [run] = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert run.data.metrics["tokens/dropped_long"] == 1 and run.data.metrics["tokens/example_max"] == max(full)
    assert run.data.params["prompt.chat_template"] == promptcheck.settings(cfg, models.load_tokenizer(world[2]))[
        "chat_template"]
    # the policy records what it was trained to read
    assert promptcheck.recorded(tmp_path / "out")["prompt_style"] == cfg.prompt_style


def short_context(model: Path, tmp_path: Path, positions: int) -> Path:
    """A copy of `model` whose config declares a context of `positions` tokens."""
    copy = tmp_path / f"ctx{positions}"
    shutil.copytree(model, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    return copy


def stage_cfg(stage, world, tmp_path, model, **extra):
    gold, db_root, _ = world
    cls = {"evaluate": configs.EvaluateConfig, "filter": configs.FilterConfig, "grpo": configs.GRPOStageConfig}[stage]
    return configs.load(cls, None, {"data": str(gold), "db_root": str(db_root), "model": str(model),
                                    "output_dir": str(tmp_path / "out"), **extra})


@pytest.mark.parametrize("stage,budget", [("evaluate", "max_new_tokens"), ("filter", "max_new_tokens"),
                                          ("grpo", "max_completion_length")])
def test_prompts_past_the_context_are_refused(world, tmp_path, no_model_loads, stage, budget):
    tokenizer = models.load_tokenizer(world[2])
    cfg = stage_cfg(stage, world, tmp_path, world[2])
    prompts = generation.prompts_for(cfg, read_gold(world[0]), tokenizer)
    longest = max(tokens.count(tokenizer, prompts))
    # the longest prompt plus 16 new tokens is one more than the context holds; the others fit
    model = short_context(world[2], tmp_path, longest + 15)
    cfg = stage_cfg(stage, world, tmp_path, model, **{budget: 16})
    main = {"evaluate": evaluate.main, "filter": filter_stage.main, "grpo": grpo.main}[stage]
    with pytest.raises(SlmsqlError, match=rf"1 of 3 prompts leave no room for 16 new tokens.*context of "
                                          rf"{longest + 15} tokens.*question '2', {longest} prompt tokens"):
        main(cfg)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    assert not mlflow.search_runs(search_all_experiments=True).shape[0]


def test_a_policy_is_prompted_as_it_was_trained(world, tmp_path):
    policy = tmp_path / "policy"
    shutil.copytree(world[2], policy)
    cfg = stage_cfg("evaluate", world, tmp_path, policy, prompt_style="omnisql", example_values=2, limit=1,
                    max_new_tokens=4, workers=1)
    promptcheck.record(policy, promptcheck.settings(cfg, models.load_tokenizer(policy)))
    other = stage_cfg("evaluate", world, tmp_path, policy, prompt_style="compact")
    with pytest.raises(SlmsqlError, match=r"trained on other prompts.*prompt_style: trained 'omnisql', now "
                                          r"'compact'.*system_prompt.*--allow-prompt-change"):
        evaluate.main(other)
    assert not (tmp_path / "out").exists()
    # its own settings pass, and the run logs them
    evaluate.main(cfg)
    [run] = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert run.data.params["prompt.system_prompt"] == promptcheck.recorded(policy)["system_prompt"] != "none"
    assert run.data.metrics["tokens/prompt_max"] > 0 and run.data.metrics["n"] == 1
    # its one answer's length, and whether it reached the 4-token budget (an untrained model seldom stops)
    [answer] = [json.loads(line)["completion"] for line in (tmp_path / "out/predictions.jsonl").open()]
    [n] = tokens.count(models.load_tokenizer(policy), [answer])
    assert run.data.metrics["tokens/answer_max"] == n and run.data.metrics["tokens/answer_at_budget"] == (n >= 3)
    # on purpose: allowed, with a warning
    evaluate.main(stage_cfg("evaluate", world, tmp_path, policy, prompt_style="compact", allow_prompt_change=True,
                            limit=1, max_new_tokens=4, workers=1, overwrite=True))


def test_answers_that_reach_the_generation_budget_are_counted_and_warned_about(world, caplog):
    """A model that explains before its SQL loses the query to the budget (the 1.5B at 96 tokens): one answer in
    four at the budget warns, naming the share and the option; none within two tokens of it is quiet."""
    tokenizer = models.load_tokenizer(world[2])
    long = " ".join(SQL * 4)
    [n] = tokens.count(tokenizer, [long])
    answers = [SQL[0]] * 3 + [long]
    got = tokens.answer_budget(tokenizer, answers, new_tokens=n + 1, source="gold.jsonl")  # n is within one
    assert got["tokens/answer_at_budget"] == 0.25 and got["tokens/answer_max"] == n
    assert f"gold.jsonl: 25% of 4 answers reached the budget of {n + 1} new tokens" in caplog.text
    assert "--max-new-tokens" in caplog.text
    caplog.clear()
    assert tokens.answer_budget(tokenizer, answers, new_tokens=n + 2, source="gold.jsonl")[
        "tokens/answer_at_budget"] == 0 and not caplog.text
    assert tokens.answer_budget(tokenizer, [], new_tokens=4, source="gold.jsonl") == {}


def test_an_adapter_carries_its_prompt_record():
    """An adapter downloaded from the Hub (models.adapter_folder) or copied into a stack keeps its record."""
    assert promptcheck.RECORD in models.ADAPTER_FILES


def test_tables_json_option_builds_the_prompts_from_it(world, tmp_path):
    from slmsql.inputs.prompts import builder_for

    tables = tmp_path / "tables.json"
    tables.write_text(json.dumps([{
        "db_id": "shop", "table_names_original": ["Stock Item"], "column_names_original": [[-1, "*"], [0, "Label"]],
        "column_types": ["text", "text"], "primary_keys": [], "foreign_keys": []}]))
    cfg = stage_cfg("evaluate", world, tmp_path, world[2], tables_json=str(tables))
    assert "`Stock Item`" in builder_for(cfg).messages({"db_id": "shop", "question": "q"})[-1]["content"]
    plain = stage_cfg("evaluate", world, tmp_path, world[2])
    assert "CREATE TABLE item" in builder_for(plain).messages({"db_id": "shop", "question": "q"})[-1]["content"]
    tok = models.load_tokenizer(world[2])
    assert promptcheck.settings(cfg, tok)["schema_source"] == "tables.json" != promptcheck.settings(plain, tok)[
        "schema_source"]
    assert "--tables-json {tables_json}" in mlproject.render()


def test_pipeline_recipes_apply_under_wiring_and_overrides(tmp_path):
    (tmp_path / "sft.yaml").write_text("use_lora: true\nlearning_rate: 2e-4\nmax_steps: 7\n")
    (tmp_path / "grpo.yaml").write_text("trainer_args: {gradient_checkpointing: true}\nmax_steps: 5\n")
    recipes = workflow.recipes_of(str(tmp_path))
    assert recipes["sft"] == {"use_lora": "true", "learning_rate": "0.0002", "max_steps": "7"}
    steps = workflow.Steps.__new__(workflow.Steps)
    steps.recipes, steps.overrides, steps.out = recipes, {"sft.max_steps": 9}, tmp_path / "o"
    steps.experiment, steps.seed = "e", 0
    p = steps.params("sft", "sft", {"learning_rate": "1e-3", "model": "m"})
    assert (p["use_lora"], p["learning_rate"], p["max_steps"], p["model"]) == ("true", "1e-3", 9, "m")
    assert steps.params("grpo", "grpo", {})["trainer_args"] == "gradient_checkpointing=True"
    cfg = workflow.stage_config("grpo", steps.params("grpo", "grpo", {}))
    assert cfg["trainer_args"] == {"gradient_checkpointing": True} and cfg["max_steps"] == 5


def test_pipeline_recipes_refuse_bad_files(tmp_path):
    (tmp_path / "sft.yaml").write_text("use_lora: true\nlearnin_rate: 1\n")
    with pytest.raises(DataError, match=r"sft.yaml: field 'learnin_rate': unknown field"):
        workflow.recipes_of(str(tmp_path))
    (tmp_path / "sft.yaml").write_text("use_lora: true\n")
    (tmp_path / "gpro.yaml").write_text("max_steps: 1\n")
    with pytest.raises(SlmsqlError, match=r"gpro.yaml: named for no stage"):
        workflow.recipes_of(str(tmp_path))
    with pytest.raises(SlmsqlError, match=r"--recipes .*nowhere: no such folder"):
        workflow.recipes_of(str(tmp_path / "nowhere"))


class FakeSteps:
    """Stands in for workflow.Steps: records each step's parameters, runs nothing. The SFT step reports the
    policy kind a LoRA SFT run tags."""

    def __init__(self, experiment_id, **kwargs):
        import types

        self.calls, self.experiment_id, self.out, self.types = {}, experiment_id, Path("out"), types
        self.policy_kind = FakeSteps.policy_kind

    def run(self, stage, name, tags=None, **given):
        t = self.types
        self.calls[name] = (stage, given)
        metrics = {"ex": 0.5, "vs_baseline/p": 1.0, "band": 3.0}
        return t.SimpleNamespace(info=t.SimpleNamespace(run_id=f"id-{name}", run_name=name, experiment_id="0"), data=t.SimpleNamespace(
            metrics=metrics, tags={"slmsql.policy_kind": self.policy_kind, "slmsql.verdict": "no significant difference"}))

    def uri(self, run, path):
        return f"runs:/{run.info.run_id}/{path}"

    def config(self, stage, name, **given):  # as Steps.config, without overrides or recipes
        from slmsql.workflow.steps import resolved

        return resolved(stage, given)


@pytest.mark.parametrize("kind", ["adapter", "full"])
def test_pipeline_on_a_pretrained_model_wires_zero_shot_and_the_sft_adapter(monkeypatch, kind):
    from slmsql.stages import pipeline

    FakeSteps.policy_kind = kind
    made = {}
    monkeypatch.setattr(pipeline, "Steps", lambda *a, **k: made.setdefault("s", FakeSteps(*a, **k)))
    # the fake runs are not in the store: record how the pipeline links them instead of writing descriptions
    monkeypatch.setattr("slmsql.tracking.descriptions.link_pipeline", lambda parent, trained, evals: made.update(
        links=({k: r.info.run_id for k, r in trained.items()}, {k: sorted(v) for k, v in evals.items()})))
    pipeline.main(configs.PipelineConfig(model="org/some-chat-model"))
    calls = made["s"].calls
    assert "tiny-model" not in calls
    assert list(calls)[:3] == ["toy", "eval-zeroshot-dev", "eval-zeroshot-dev_cross"]
    assert calls["eval-zeroshot-dev"][1]["model"] == "org/some-chat-model" and "adapter" not in calls["eval-zeroshot-dev"][1]
    assert calls["sft"][1]["model"] == "org/some-chat-model"
    sft_eval, grpo_eval = calls["eval-sft-dev"][1], calls["eval-grpo-dev"][1]
    assert sft_eval["baseline_run"] == "id-eval-zeroshot-dev" and grpo_eval["baseline_run"] == "id-eval-sft-dev"
    assert grpo_eval["adapter"] == "runs:/id-grpo/adapter"
    if kind == "adapter":  # the adapter rides on the pretrained model everywhere
        assert (calls["filter"][1]["model"], calls["filter"][1]["adapter"]) == ("org/some-chat-model", "runs:/id-sft/policy")
        assert {k: calls["grpo"][1][k] for k in ("model", "base_adapter", "adapter_mode")} == {
            "model": "org/some-chat-model", "base_adapter": "runs:/id-sft/policy", "adapter_mode": "continue"}
        assert sft_eval["adapter"] == "runs:/id-sft/policy" and grpo_eval["model"] == "org/some-chat-model"
        assert calls["publish"][1]["base_repo"] == ""  # the base is on the Hub already
    else:  # a full fine-tune is a model of its own, pushed as the adapter's base
        assert calls["filter"][1]["model"] == calls["grpo"][1]["model"] == "runs:/id-sft/policy"
        assert calls["publish"][1]["base_repo"] == "slmsql/toy-sft"
    assert made["links"] == ({"sft": "id-sft", "grpo": "id-grpo"},
                             {p: ["dev", "dev_cross"] for p in ("zeroshot", "sft", "grpo")})


def test_toy_pipeline_builds_the_tiny_model_and_evaluates_no_zero_shot(monkeypatch):
    from slmsql.stages import pipeline

    FakeSteps.policy_kind = "full"
    made = {}
    monkeypatch.setattr(pipeline, "Steps", lambda *a, **k: made.setdefault("s", FakeSteps(*a, **k)))
    # the fake runs are not in the store: record how the pipeline links them instead of writing descriptions
    monkeypatch.setattr("slmsql.tracking.descriptions.link_pipeline", lambda parent, trained, evals: made.update(
        links=({k: r.info.run_id for k, r in trained.items()}, {k: sorted(v) for k, v in evals.items()})))
    pipeline.main(configs.PipelineConfig())
    calls = made["s"].calls
    assert list(calls)[:3] == ["toy", "tiny-model", "sft"] and not any("zeroshot" in c for c in calls)
    assert calls["sft"][1]["model"] == "runs:/id-tiny-model/model" and calls["eval-sft-dev"][1]["baseline_run"] == ""
    assert made["links"][1] == {p: ["dev", "dev_cross"] for p in ("sft", "grpo")}  # no zero-shot evaluations
