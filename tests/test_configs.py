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

    root = Path(__file__).parents[1] / "recipes"  # recipes/<model>/<stage>.yaml; accelerate/ holds launcher configs
    recipes = sorted(p for p in root.glob("*/*.yaml") if p.parent.name != "accelerate")
    assert recipes
    for path in recipes:
        configs.load(configs.STAGES[path.stem], str(path), {}, require=False)


def test_cli_missing_required_exits_nonzero():
    result = CliRunner().invoke(main, ["evaluate", "--data", "x.jsonl"])
    assert result.exit_code == 2
    assert "--db-root" in result.output


def test_cli_bool_flag_forms():
    cfg = configs.load(configs.ToyConfig, None, {"overwrite": True})
    assert cfg.overwrite is True


def test_accelerate_configs_parse():
    import yaml
    from pathlib import Path

    for name in ("ddp", "zero2"):
        doc = yaml.safe_load((Path(__file__).parents[1] / "recipes" / "accelerate" / f"{name}.yaml").read_text())
        assert doc["distributed_type"] in ("MULTI_GPU", "DEEPSPEED")
