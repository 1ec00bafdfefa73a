"""`--match spider` reaches every consumer: scoring of golds, the execution reward, evaluate and the filter.

test_matching.py checks the two semantics on row lists. Here each consumer runs on predictions whose verdict
*differs* between the modes, so a consumer that dropped the mode (and fell back to the bird default) gives
the bird verdicts and fails. The database is conftest's `shop`:

    item(id, name, price, kind): (1, pen, 1.5, office), (2, cup, 4.0, kitchen), (3, pad, 2.25, office),
                                 (4, pot, 9.0, kitchen)
"""

from __future__ import annotations

import json

import mlflow
import pytest
from click.testing import CliRunner

from slmsql.rewards import registry as rewards
from slmsql.cli import main as cli
from inline import InlineExecutor

from slmsql.sql.scoring import judge

DUPS = "SELECT kind FROM item"  # office, kitchen, office, kitchen: duplicate rows
ORDERED = "SELECT name FROM item ORDER BY price"  # pen, pad, cup, pot: order is part of the answer
PAIR = "SELECT name, price FROM item WHERE kind = 'office'"
COUNT = "SELECT count(*) FROM item"

# (gold, prediction, correct under bird, correct under spider)
CASES = {
    "duplicates_dropped": (DUPS, "SELECT DISTINCT kind FROM item", True, False),
    "duplicates_added": ("SELECT DISTINCT kind FROM item", DUPS, True, False),
    "wrong_order_with_order_by": (ORDERED, "SELECT name FROM item ORDER BY price DESC", True, False),
    "columns_permuted": (PAIR, "SELECT price, name FROM item WHERE kind = 'office'", False, True),
    # controls: the same verdict in both modes
    "order_free_without_order_by": (DUPS, "SELECT kind FROM item ORDER BY id DESC", True, True),
    "same_order": (ORDERED, "SELECT name FROM item ORDER BY price ASC", True, True),
    "wrong_rows": (PAIR, "SELECT name, price FROM item", False, False),
}
MODE = {"bird": 2, "spider": 3}  # index of the verdict in CASES


def _db(shop) -> str:
    return str(shop / "shop" / "shop.sqlite")


@pytest.mark.parametrize("match", ["bird", "spider"])
def test_judge_scores_golds_under_each_mode(shop, match):
    db = _db(shop)
    outcomes = judge([(db, pred, gold) for gold, pred, *_ in CASES.values()], InlineExecutor(), match)
    assert {name: o.correct for name, o in zip(CASES, outcomes)} == {
        name: case[MODE[match]] for name, case in CASES.items()}
    assert {o.status for o in outcomes} == {"ok"}  # every prediction ran; only the comparison differs


def test_the_modes_disagree_on_the_differing_cases(shop):
    """The cases above really separate the modes (else the tests could not tell them apart)."""
    db = _db(shop)
    items = [(db, pred, gold) for gold, pred, *_ in CASES.values()]
    bird = [o.correct for o in judge(items, InlineExecutor(), "bird")]
    spider = [o.correct for o in judge(items, InlineExecutor(), "spider")]
    assert sum(b != s for b, s in zip(bird, spider)) == 4


def _batch(shop):
    gold, preds = zip(*[(g, p) for g, p, *_ in CASES.values()])
    completions = [f"```sql\n{p}\n```" for p in preds]
    return completions, {"sql": list(gold), "db_path": [_db(shop)] * len(gold)}


@pytest.mark.parametrize("match", ["bird", "spider"])
def test_execution_reward_follows_the_mode(shop, match):
    completions, cols = _batch(shop)
    got = rewards.execution_reward(None, completions, executor=InlineExecutor(), match=match, **cols)
    # a wrong answer that runs earns the `runs` tier (0.1), a right one 1.0
    assert got == [1.0 if case[MODE[match]] else 0.1 for case in CASES.values()]


def test_registry_reward_binds_the_mode(shop):
    """What `grpo` hands TRL: rewards.build(..., match=cfg.match)."""
    completions, cols = _batch(shop)
    (spider,) = rewards.build(["execution"], executor=InlineExecutor(), match="spider")
    (bird,) = rewards.build(["execution"], executor=InlineExecutor())
    kw = dict(prompts=["p"] * len(completions), completions=completions, completion_ids=None, trainer_state=None)
    assert spider(**kw, **cols) == [1.0 if c[3] else 0.1 for c in CASES.values()]
    assert bird(**kw, **cols) == [1.0 if c[2] else 0.1 for c in CASES.values()]


# ---- evaluate --predictions ... --match spider ----------------------------------------------------------

def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("match", ["bird", "spider"])
def test_evaluate_cli_scores_and_tags_the_mode(shop, tmp_path, match):
    gold = _write(tmp_path / "gold.jsonl", [{"id": n, "db_id": "shop", "question": f"q {n}", "sql": g}
                                            for n, (g, *_) in CASES.items()])
    preds = _write(tmp_path / "preds.jsonl", [{"id": n, "sql": p} for n, (_, p, *_) in CASES.items()])
    out = tmp_path / "out"
    args = ["evaluate", "--data", str(gold), "--db-root", str(shop), "--predictions", str(preds),
            "--output-dir", str(out), "--workers", "1"] + (["--match", match] if match != "bird" else [])
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output

    rows = {r["id"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    expected = {name: case[MODE[match]] for name, case in CASES.items()}
    assert {k: r["correct"] for k, r in rows.items()} == expected
    # every prediction ran: its status is its outcome, as the tables and metrics name it
    assert {k: r["status"] for k, r in rows.items()} == {k: "correct" if v else "wrong_result" for k, v in expected.items()}
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n_correct"] == sum(expected.values())

    (run,) = mlflow.search_runs(experiment_names=["slmsql"], output_format="list")
    assert run.data.tags["slmsql.match"] == match and run.data.params["match"] == match
    assert run.data.metrics["n_correct"] == sum(expected.values())


# ---- filter --match spider ------------------------------------------------------------------------------

# k = 2 completions per question; (gold, completions, bucket under bird, bucket under spider)
FILTER = {
    "dups": (DUPS, ["SELECT kind FROM item ORDER BY id DESC", "SELECT DISTINCT kind FROM item"],
             "all_pass", "band"),
    "perm": (PAIR, ["SELECT price, name FROM item WHERE kind = 'office'", "SELECT name FROM item"],
             "all_fail", "band"),
    "order": (ORDERED, [ORDERED, "SELECT name FROM item ORDER BY price DESC"], "all_pass", "band"),
    "count": (COUNT, [COUNT, "SELECT 5"], "band", "band"),  # the band is never empty (the rl check, --min-band 1)
}


@pytest.fixture
def fake_policy(monkeypatch):
    """No model: the filter's sampler returns FILTER's completions for each question, in order."""
    from slmsql.generation import sampling as generation
    from slmsql.policy import models

    def complete(cfg, examples, policy, *, k, **_):
        assert k == 2
        return [[f"```sql\n{c}\n```" for c in FILTER[e.id][1]] for e in examples]

    monkeypatch.setattr(models, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(generation, "complete", complete)


@pytest.mark.parametrize("match", ["bird", "spider"])
@pytest.mark.slow
def test_filter_cli_buckets_under_the_mode(shop, tmp_path, fake_policy, match):
    data = _write(tmp_path / "source.jsonl", [{"id": n, "db_id": "shop", "question": f"q {n}", "sql": g}
                                              for n, (g, *_) in FILTER.items()])
    out = tmp_path / "out"
    from slmsql.toy.tiny_model import build_tiny_model  # a real tokenizer: prompts are counted before sampling

    tiny = build_tiny_model(tmp_path / "tiny", ["q 1", "SELECT 1"], vocab_size=300, hidden=16, layers=1, heads=2, ffn=32)
    args = ["filter", "--data", str(data), "--db-root", str(shop), "--model", str(tiny), "--output-dir", str(out),
            "--k", "2", "--workers", "1", "--min-band", "1"] + (["--match", match] if match != "bird" else [])
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output

    col = 2 if match == "bird" else 3
    rates = {r["id"]: r for r in map(json.loads, (out / "passrates.jsonl").read_text().splitlines())}
    assert {k: r["bucket"] for k, r in rates.items()} == {k: case[col] for k, case in FILTER.items()}
    band = [json.loads(line)["id"] for line in (out / "band.jsonl").read_text().splitlines()]
    assert band == [k for k, case in FILTER.items() if case[col] == "band"]
    if match == "spider":  # which completion was right is recorded per sample
        assert rates["dups"]["statuses"] == rates["perm"]["statuses"] == ["correct", "wrong_result"]
    (run,) = mlflow.search_runs(experiment_names=["slmsql"], output_format="list")
    assert run.data.params["match"] == match and run.data.metrics["band"] == len(band)
