"""The reward sets of recipes/rewards/: they stack after a model's recipe, hold their one rule (no degenerate
completion outscores a correct one), and run `slmsql grpo` in a new process with each reward logged."""

import json
import sqlite3
import sys
from pathlib import Path

import mlflow
import pytest
from inline import InlineExecutor
from policy import policy_fixture, read, write  # noqa: F401  (the fixture)
import watched

from slmsql import configs
from slmsql.rewards import registry as rewards
from slmsql.errors import DataError

ROOT = Path(__file__).resolve().parent.parent
SETS = {name: ROOT / "recipes" / "rewards" / f"{name}.yaml" for name in ("outcome", "dense", "qatch")}


def reward_set(name, base=None):
    recipe = ",".join(str(p) for p in (base, SETS[name]) if p)
    return configs.load(configs.GRPOStageConfig, recipe)


def test_each_set_names_registered_rewards_with_one_weight_each():
    for name in SETS:
        cfg = reward_set(name)
        rewards.check(cfg.rewards, cfg.reward_weights)
        assert len(cfg.reward_weights) == len(cfg.rewards) and "execution" in cfg.rewards, name
    assert reward_set("outcome").rewards == configs.GRPOStageConfig().rewards  # today's default, written out


def test_a_reward_set_stacks_after_a_model_recipe(tmp_path):
    model = ROOT / "recipes" / "smollm2-135m" / "grpo.yaml"
    cfg = reward_set("dense", base=model)
    alone = configs.load(configs.GRPOStageConfig, str(model))
    assert cfg.rewards == ["execution", "schema_linking", "ngram", "syntax", "format"]
    assert (cfg.model, cfg.learning_rate, cfg.trainer_args) == (alone.model, alone.learning_rate, alone.trainer_args)
    # a later recipe's keys win, trainer_args merge, the command line still wins over both
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("learning_rate: 0.1\ntrainer_args: {warmup_steps: 2, max_grad_norm: 0.5}\n")
    b.write_text("learning_rate: 0.2\ntrainer_args: {max_grad_norm: 0.7}\n")
    got = configs.load(configs.GRPOStageConfig, f"{a}, {b}", {"seed": 3})
    assert (got.learning_rate, got.trainer_args, got.seed) == (0.2, {"warmup_steps": 2, "max_grad_norm": 0.7}, 3)
    b.write_text("rewardz: [execution]\n")
    with pytest.raises(DataError, match=r"b\.yaml.*rewardz"):  # the error names the stacked file at fault
        configs.load(configs.GRPOStageConfig, f"{a},{b}")


# ---- the rule: a degenerate completion never outscores a correct one -----------------------------------------

JOIN_GOLD = "SELECT i.name FROM item AS i JOIN sale AS s ON s.item_id = i.id WHERE s.qty > 2"  # pen, pot
CASES = {
    "SELECT name FROM item WHERE kind = 'office'": (  # pen, pad
        ["SELECT name FROM item WHERE kind = 'office'", "SELECT it.name FROM item it WHERE it.price < 3",
         "SELECT name FROM item WHERE id IN (SELECT id FROM item WHERE kind = 'office')"],
        ["SELECT * FROM item", "SELECT * FROM item, sale", "SELECT name FROM item",
         "SELECT name FROM item WHERE kind = 'kitchen'", "SELECT name, kind FROM item WHERE kind = 'office'",
         "SELECT name FROM item WHERE kind = 'office", "SELECT * FROM item WHERE kind = 'office'"]),
    JOIN_GOLD: (
        [JOIN_GOLD, "SELECT name FROM item WHERE id IN (SELECT item_id FROM sale WHERE qty > 2)",
         "WITH big AS (SELECT item_id FROM sale WHERE qty > 2) SELECT name FROM item JOIN big ON item_id = id"],
        ["SELECT * FROM item, sale", "SELECT * FROM item JOIN sale ON sale.item_id = item.id",
         "SELECT i.name FROM item AS i JOIN sale AS s ON s.item_id = i.id",  # the gold's tables, no condition
         "SELECT i.name FROM item AS i JOIN sale AS s ON s.item_id = i.id WHERE s.qty > 1", "SELECT name FROM item"]),
}


@pytest.fixture
def shop_sales(shop):
    db = shop / "shop" / "shop.sqlite"
    con = sqlite3.connect(db)
    con.executescript("CREATE TABLE sale (id INTEGER PRIMARY KEY, item_id INTEGER, qty INTEGER);"
                      "INSERT INTO sale VALUES (1, 1, 5), (2, 2, 1), (3, 4, 3), (4, 3, 2);")
    con.commit()
    con.close()
    return str(db)


def totals(cfg, gold, sqls, db, fenced):
    """TRL's sum: each reward times its weight, per completion (fenced in a ```sql block, or bare)."""
    comps = [f"```sql\n{s}\n```" if fenced else s for s in sqls]
    fns = rewards.build(cfg.rewards, executor=InlineExecutor(), match=cfg.match,
                        tiers=rewards.Tiers(runs=cfg.runs_tier, format=cfg.format_tier))
    cols = {"sql": [gold] * len(sqls), "db_path": [db] * len(sqls)}
    per_fn = [fn(prompts=["p"] * len(sqls), completions=comps, **cols) for fn in fns]
    return [sum(w * r[i] for w, r in zip(cfg.reward_weights, per_fn)) for i in range(len(sqls))]


@pytest.mark.parametrize("name", list(SETS))
def test_no_degenerate_completion_outscores_a_correct_one(name, shop_sales):
    cfg = reward_set(name)
    for gold, (right, wrong) in CASES.items():
        rewards.check(cfg.rewards)
        executed = rewards.build(["execution"], executor=InlineExecutor())[0]
        assert executed(prompts=None, completions=right, sql=[gold] * len(right), db_path=[shop_sales] * len(right)) \
            == [1.0] * len(right), "every `right` answer must be right"
        assert 1.0 not in executed(prompts=None, completions=wrong, sql=[gold] * len(wrong),
                                   db_path=[shop_sales] * len(wrong))
        # the worst right answer is bare (no format reward); the best wrong one fenced
        worst_right, best_wrong = min(totals(cfg, gold, right, shop_sales, False)), \
            max(totals(cfg, gold, wrong, shop_sales, True))
        assert worst_right > best_wrong, (name, gold, worst_right, best_wrong)


def test_the_dense_set_pays_partial_credit_where_the_outcome_set_cannot(shop_sales):
    """What the dense set is for: among wrong answers that all run (outcome: one reward, no signal), the one
    closer to the gold scores higher."""
    gold = "SELECT name FROM item WHERE kind = 'office'"
    near, far = "SELECT name FROM item WHERE kind = 'kitchen'", "SELECT * FROM item, sale"
    outcome = totals(reward_set("outcome"), gold, [near, far], shop_sales, True)
    dense = totals(reward_set("dense"), gold, [near, far], shop_sales, True)
    assert outcome[0] == outcome[1] and dense[0] > dense[1]


def test_dropping_the_condition_pays_under_qatch_below_a_pass_rate(shop_sales):
    """The loophole the rule above does not close: a query without its WHERE clause returns every gold cell (cell
    recall 1) whatever the condition, so QATCH pays it a sure partial credit, which beats trying whenever the
    policy's chance q of a right condition is below q* = (dropped - wrong) / (right - wrong). The transfer study's
    qatch-seed0 collapsed onto it (docs/stages/grpo.md). Outcome-only has no such q*: dropping the condition scores
    what a wrong one does."""
    gold = "SELECT name FROM item WHERE kind = 'office'"  # pen and pad, of pen, cup, pad, pot
    answers = [gold, "SELECT name FROM item", "SELECT name FROM item WHERE kind = 'kitchen'"]

    def breakeven(name):
        right, dropped, wrong = totals(reward_set(name), gold, answers, shop_sales, True)
        return (dropped - wrong) / (right - wrong)

    assert breakeven("outcome") == 0.0
    # by hand, from qatch.yaml's weights: right 1 + 0.5 + 0.5 + 0.2 (format) = 2.2; the wrong condition runs (0.1)
    # and shares no cell with the gold: 0.3; no condition: 0.1 + 0.5 x precision 2/4 + 0.5 x recall 1 + 0.2 = 1.05
    assert breakeven("qatch") == pytest.approx((1.05 - 0.3) / (2.2 - 0.3))  # 0.39


# ---- a reward set on the toy, in a new process -------------------------------------------------------------

@pytest.mark.slow
def test_grpo_with_the_dense_set_logs_every_reward(policy, tmp_path):
    data = write(tmp_path / "band.jsonl", [{**r, "pass_rate": 0.5} for r in read(policy.train)[:4]])
    cmd = [sys.executable, "-c", "from slmsql.cli import main; main()", "grpo", "--recipe", str(SETS["dense"]),
           "--data", str(data),
           "--db-root", str(policy.db_root), "--model", str(policy.model), "--output-dir", str(tmp_path / "out"),
           "--max-steps", "2", "--num-generations", "4", "--per-device-train-batch-size", "8",
           "--max-completion-length", "32", "--save-steps", "2", "--completions-every", "2", "--workers", "1",
           "--lora-r", "8", "--lora-alpha", "16", "--experiment", "dense"]
    proc = watched.run(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = mlflow.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("dense").experiment_id])
    cfg = reward_set("dense")
    assert run.data.params["rewards"] == ",".join(cfg.rewards)
    assert run.data.params["reward_weights"] == ",".join(map(str, cfg.reward_weights))
    for name in cfg.rewards:  # each reward per step, as TRL names it
        steps = client.get_metric_history(run.info.run_id, f"rewards/{name}/mean")
        assert sorted(h.step for h in steps) == [1, 2], name
        assert all(0.0 <= h.value <= 1.0 for h in steps), name
    # and per completion in the completions table, beside the status
    path = client.download_artifacts(run.info.run_id, "completions/step_00002.json")
    table = json.loads(Path(path).read_text())
    assert {"status", *cfg.rewards} <= set(table["columns"]) and len(table["data"]) == 8
