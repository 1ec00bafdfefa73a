import pytest
from click.testing import CliRunner

from slmsql import configs
from slmsql.cli import main
from slmsql.errors import DataError, SlmsqlError


def test_precedence_default_recipe_cli(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1.0e-5\nmax_steps: 7\ntrainer_args: {warmup_ratio: 0.1}\n")
    cfg = configs.load(configs.GRPOStageConfig, str(recipe), {"max_steps": "9", "learning_rate": None})
    assert (cfg.learning_rate, cfg.max_steps, cfg.beta) == (1e-5, 9, 0.0)
    assert cfg.trainer_args == {"warmup_ratio": 0.1}
    # mlflow run passes defaults explicitly: there a default-valued CLI value must not undo the recipe ...
    default = str(configs.GRPOStageConfig().learning_rate)
    cfg = configs.load(configs.GRPOStageConfig, str(recipe), {"learning_rate": default}, defaults_yield=True)
    assert cfg.learning_rate == 1e-5
    # ... while a user typing the default value on the plain CLI means it
    cfg = configs.load(configs.GRPOStageConfig, str(recipe), {"learning_rate": default})
    assert cfg.learning_rate == float(default)


def test_trainer_args_merge_and_parse():
    assert configs.parse_trainer_args("bf16=true warmup_ratio=0.1,optim=adamw_torch") == {
        "bf16": True, "warmup_ratio": 0.1, "optim": "adamw_torch"}
    with pytest.raises(SlmsqlError, match="key=value"):
        configs.parse_trainer_args("oops")


def test_mlproject_style_values_coerce():
    cfg = configs.load(configs.FilterConfig, None, {"k": "8.0", "overwrite": "true", "low": "0.25"})
    assert (cfg.k, cfg.overwrite, cfg.low) == (8, True, 0.25)


@pytest.mark.parametrize("doc, match", [
    ("lerning_rate: 1\n", "field 'lerning_rate': unknown field"),
    ("max_steps: many\n", "field 'max_steps': expected int"),
    ("adapter_mode: merge\n", "field 'adapter_mode': must be one of"),
    ("a: [1\n", "malformed YAML"),
])
def test_bad_recipes(tmp_path, doc, match):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(doc)
    with pytest.raises(DataError, match=match):
        configs.load(configs.GRPOStageConfig, str(recipe), {})


def test_every_recipe_in_repo_loads():
    from pathlib import Path

    # recipes/<model>/<stage>.yaml; accelerate/ holds launcher configs; rewards/ GRPO reward sets; eval-sets/
    # evaluate recipes naming an eval set; answers/ evaluate overlays on how the answer is asked for
    root = Path(__file__).parents[1] / "recipes"
    overlays = ("accelerate", "rewards", "eval-sets", "answers")
    recipes = sorted(p for p in root.glob("*/*.yaml") if p.parent.name not in overlays)
    reward_sets = sorted((root / "rewards").glob("*.yaml"))
    eval_sets = sorted((root / "eval-sets").glob("*.yaml"))
    answers = sorted((root / "answers").glob("*.yaml"))
    assert recipes and reward_sets and eval_sets and answers
    for path in answers:
        assert configs.load(configs.EvaluateConfig, str(path), {}, require=False).answer_prefix
    for path in recipes:
        configs.load(configs.STAGES[path.stem], str(path), {}, require=False)
    for path in reward_sets:
        configs.load(configs.GRPOStageConfig, str(path), {}, require=False)
    for path in eval_sets:
        cfg = configs.load(configs.EvaluateConfig, str(path), {}, require=False)
        assert cfg.dataset_name == path.stem  # the set's name is its file's


def test_cli_missing_required_exits_nonzero():
    result = CliRunner().invoke(main, ["evaluate", "--data", "x.jsonl"])
    assert result.exit_code == 2
    assert "--db-root" in result.output


@pytest.fixture
def grpo_config(monkeypatch):
    """Run the real `slmsql grpo` command line; return the config that reaches the stage (which does not run)."""
    import importlib

    from slmsql import cli

    seen = []
    monkeypatch.setattr(importlib.import_module(cli.stage_module("grpo")), "main", seen.append)  # looked up at call time

    def invoke(*argv):
        result = CliRunner().invoke(main, ["grpo", *argv])
        assert result.exit_code == 0, result.output
        (cfg,) = seen[-1:]
        seen.clear()
        return cfg

    return invoke


# `resume` defaults to False, `use_lora` to True: each form must be able to move each away from its default.
@pytest.mark.parametrize("argv, resume, use_lora", [
    ([], False, True),
    (["--resume"], True, True),  # bare flag, last on the line
    (["--resume", "--use-lora", "false"], True, False),  # bare flag followed by another option
    (["--use-lora", "false", "--resume"], True, False),
    (["--resume", "true", "--use-lora", "true"], True, True),
    (["--resume", "false", "--use-lora", "false"], False, False),
    (["--resume", "TRUE", "--use-lora", "0"], True, False),  # click's BOOL spellings
    (["--resume", "yes", "--use-lora", "no"], True, False),
])
def test_cli_bool_flag_forms(grpo_config, argv, resume, use_lora):
    cfg = grpo_config(*argv)
    assert (cfg.resume, cfg.use_lora) == (resume, use_lora)
    assert type(cfg.resume) is bool and type(cfg.use_lora) is bool


def test_cli_bool_flag_against_a_recipe(grpo_config, tmp_path, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("resume: true\nuse_lora: false\n")
    assert (lambda c: (c.resume, c.use_lora))(grpo_config("--recipe", str(recipe))) == (True, False)
    # on the plain command line an explicit value wins, even when it equals the default ...
    cfg = grpo_config("--recipe", str(recipe), "--resume", "false", "--use-lora")
    assert (cfg.resume, cfg.use_lora) == (False, True)
    # ... while under `mlflow run` (which passes every parameter, defaults included) the recipe keeps its value
    monkeypatch.setenv("MLFLOW_RUN_ID", "0" * 32)
    cfg = grpo_config("--recipe", str(recipe), "--resume", "false", "--use-lora", "true")
    assert (cfg.resume, cfg.use_lora) == (True, False)


def test_cli_bool_flag_bad_value():
    result = CliRunner().invoke(main, ["grpo", "--resume", "maybe"])
    assert result.exit_code == 2 and "--resume" in result.output and "'maybe'" in result.output


def test_accelerate_configs_parse():
    import yaml
    from pathlib import Path

    for name in ("ddp", "zero2"):
        doc = yaml.safe_load((Path(__file__).parents[1] / "recipes" / "accelerate" / f"{name}.yaml").read_text())
        assert doc["distributed_type"] in ("MULTI_GPU", "DEEPSPEED")


def test_recipe_scalars_follow_yaml_1_2(tmp_path):
    """`no`/`off` stay strings (TRL's save_strategy="no"), 1e-5 is a float, true/false and a bool field's
    yes/no still mean booleans."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1e-5\nuse_lora: no\nresume: yes\n"
                      "trainer_args: {save_strategy: no, report_to: off, warmup_ratio: 5e-2, bf16: false}\n")
    cfg = configs.load(configs.GRPOStageConfig, str(recipe), {})
    assert cfg.trainer_args == {"save_strategy": "no", "report_to": "off", "warmup_ratio": 0.05, "bf16": False}
    assert (cfg.learning_rate, cfg.use_lora, cfg.resume) == (1e-5, False, True)
