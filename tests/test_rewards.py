import pytest

from slmsql.rewards import registry as rewards
from inline import InlineExecutor


@pytest.fixture
def batch(shop):
    db = str(shop / "shop" / "shop.sqlite")
    gold = "SELECT name FROM item WHERE kind = 'office'"
    completions = [
        "```sql\nSELECT name FROM item WHERE kind = 'office'\n```",  # right, formatted
        "SELECT name FROM item WHERE price < 3",                       # right (same rows), bare
        "```sql\nSELECT name FROM item\n```",                          # runs, wrong
        "```sql\nSELECT nme FROM item\n```",                           # error
        "no idea",                                                     # no sql
    ]
    return completions, {"sql": [gold] * 5, "db_path": [db] * 5}


def test_execution_tiers(batch):
    completions, cols = batch
    got = rewards.execution_reward(None, completions, executor=InlineExecutor(), **cols)
    assert got == [1.0, 1.0, 0.1, 0.0, 0.0]


def test_tiers_configurable(batch):
    completions, cols = batch
    t = rewards.Tiers(correct=2.0, runs=0.5, fails=-1.0)
    got = rewards.execution_reward(None, completions, executor=InlineExecutor(), tiers=t, **cols)
    assert got == [2.0, 2.0, 0.5, -1.0, -1.0]


def test_format_reward(batch):
    completions, _ = batch
    assert rewards.format_reward(None, completions) == [0.2, 0.0, 0.2, 0.2, 0.0]


def test_conversational_completions(batch):
    completions, cols = batch
    conv = [[{"role": "assistant", "content": c}] for c in completions]
    assert rewards.execution_reward(None, conv, executor=InlineExecutor(), **cols)[:3] == [1.0, 1.0, 0.1]


def test_registry_names_are_stable_for_trl_metrics(batch):
    completions, cols = batch
    fns = rewards.build(["execution", "format"], executor=InlineExecutor())
    assert [f.__name__ for f in fns] == ["execution", "format"]
    from trl.trainer.utils import get_callable_name  # what TRL names rewards/<name>/mean after

    assert [get_callable_name(f) for f in fns] == ["execution", "format"]
    # TRL passes everything by keyword, dataset columns included
    out = fns[0](prompts=["p"] * 5, completions=completions, completion_ids=None, trainer_state=None, **cols)
    assert out[0] == 1.0


def test_telemetry_sink_sees_statuses(batch):
    completions, cols = batch
    seen = []
    rewards.execution_reward(None, completions, executor=InlineExecutor(), on_outcomes=seen.extend, **cols)
    assert [o.status for o in seen] == ["ok", "ok", "ok", "error", "no_sql"]
    assert [o.correct for o in seen] == [True, True, False, False, False]


def test_unknown_reward_name():
    with pytest.raises(ValueError, match="unknown reward"):
        rewards.build(["execution", "lenght"])


def test_telemetry_counts_correctness_variance_not_reward_variance(batch):
    completions, cols = batch
    metrics, extra = {}, {}
    # two groups: [right, right-ish bare, wrong-but-runs] varies; [error, no sql] is all wrong (0.0 and 0.0)
    rewards.execution_reward(None, completions, executor=InlineExecutor(), id=["a", "a", "a", "b", "b"],
                             log_metric=metrics.__setitem__, log_extra=extra.__setitem__, **cols)
    assert metrics["exec/frac_groups_correctness_varies"] == 0.5
    assert metrics["exec/correct"] == 0.4
    assert metrics["exec/wrong_result"] == 0.2 and metrics["exec/error"] == 0.2 and metrics["exec/no_sql"] == 0.2
    assert extra["status"] == ["correct", "correct", "wrong_result", "error", "no_sql"]  # as the metrics name them


def test_group_of_runs_and_fails_has_reward_std_but_no_correctness_signal(shop):
    db = str(shop / "shop" / "shop.sqlite")
    comps = ["```sql\nSELECT name FROM item\n```", "```sql\nSELECT bogus FROM item\n```"]
    cols = {"sql": ["SELECT name FROM item WHERE kind = 'office'"] * 2, "db_path": [db] * 2}
    metrics = {}
    r = rewards.execution_reward(None, comps, executor=InlineExecutor(), id=["g", "g"],
                                 log_metric=metrics.__setitem__, **cols)
    assert r == [0.1, 0.0]  # reward std > 0 ...
    assert metrics["exec/frac_groups_correctness_varies"] == 0.0  # ... but no correctness signal


def test_a_gold_too_large_pays_nothing_and_is_counted(shop):
    """A gold over the sandbox's digest budget: every answer is wrong (even the gold itself), and the step's
    telemetry names it, so the shares of the outcomes still sum to 1."""
    from slmsql.sql.sandbox import Limits

    db = str(shop / "shop" / "shop.sqlite")
    small = InlineExecutor(Limits(row_cap=2, digest_bytes=8 * 3))  # 2 rows as values, 3 values as digests
    big, fits = "SELECT name FROM item", "SELECT name FROM item WHERE id < 4"  # 4 rows; 3 rows
    comps = [f"```sql\n{big}\n```", f"```sql\n{fits}\n```"]
    metrics = {}
    r = rewards.execution_reward(None, comps, sql=[big, fits], db_path=[db] * 2, executor=small, id=["a", "b"],
                                 log_metric=metrics.__setitem__)
    assert r == [0.0, 1.0]
    assert metrics["exec/gold_too_large"] == 0.5 and metrics["exec/correct"] == 0.5
    assert sum(v for k, v in metrics.items() if k != "exec/frac_groups_correctness_varies") == 1.0
