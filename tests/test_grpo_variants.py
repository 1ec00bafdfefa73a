"""Correctness-aware GRPO (slmsql.training.grpo_variants): the gate and dynamic-sampling rules on hand-built groups,
then two real toy runs of `slmsql grpo` with the options on, on scripted completions (tests/scripted.py)."""

from __future__ import annotations

import statistics
from pathlib import Path

import mlflow
import pytest
import scripted
from learning import assert_learned, prompt_for, weight_change
from policy import policy_fixture, read, tracking_store, write  # noqa: F401  (the fixture)

from slmsql import configs
from slmsql.training import grpo_variants as gv
from slmsql.errors import SlmsqlError


def trl_advantages(rewards, group_size):
    """TRL 1.16's default advantage (scale_rewards="group"): (r - group mean) / (group sample std + 1e-4),
    written out here independently of TRL and of slmsql."""
    out = []
    for i in range(0, len(rewards), group_size):
        g = rewards[i:i + group_size]
        mean, std = statistics.fmean(g), statistics.stdev(g)
        out += [(r - mean) / (std + 1e-4) for r in g]
    return out


# ---- the gate on hand-built groups ----------------------------------------------------------------------

def test_all_wrong_group_with_shaped_rewards_gets_zero_advantage():
    rewards = [0.1, 0.0, 0.2, 0.1]  # runs-but-wrong, fails, fails + format, runs-but-wrong: all wrong
    adv = trl_advantages(rewards, 4)
    assert max(map(abs, adv)) > 0.5  # what plain GRPO would push on
    assert gv.gate(adv, [False] * 4, 4) == [0.0] * 4
    assert gv.gate(trl_advantages([1.2, 1.0, 1.2, 1.2], 4), [True] * 4, 4) == [0.0] * 4  # all correct, too


def test_mixed_group_keeps_trls_advantages_exactly():
    import torch

    # three groups: mixed, all wrong (shaped rewards vary), all correct
    rewards = [1.2, 0.3, 0.2, 1.2, 0.1, 0.0, 0.3, 0.1, 1.2, 1.2, 1.0, 1.2]
    correct = [True, False, False, True, False, False, False, False, True, True, True, True]
    adv = torch.tensor(trl_advantages(rewards, 4))
    gated = gv.gate(adv, correct, 4)
    assert torch.equal(gated[:4], adv[:4])  # bit for bit
    assert torch.equal(gated[4:], torch.zeros(8))
    assert gv.groups_varying(correct, 4) == [True, False, False]


def test_gate_refuses_ragged_input():
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        gv.groups_varying([True] * 6, 4)
    with pytest.raises(ValueError, match="3 advantages for 4 completions"):
        gv.gate([0.1, 0.2, 0.3], [True, False, True, False], 4)


# ---- dynamic sampling's selection on hand-built rounds --------------------------------------------------

def test_refill_rounds_then_top_up():
    # a batch of 4 groups; round 0 has 2 with correctness variance, each refill samples only what is missing
    rounds = [[True, False, False, True]]
    assert gv.shortfall(rounds, 4) == 2
    rounds.append([False, True])
    assert gv.shortfall(rounds, 4) == 1
    rounds.append([False])  # the last allowed round: still 1 short
    sel = gv.select(rounds, 4)
    assert sel.kept == [(0, 0), (0, 3), (1, 1)]
    assert sel.filled == [(0, 1)]  # the first dropped group sampled
    assert (sel.sampled, sel.dropped, len(sel.batch)) == (7, 4, 4)
    assert len(sel.kept) + sel.dropped == sel.sampled
    assert sel.advantage_mask(gated=True, group_size=2) == [1.0] * 6 + [0.0] * 2
    assert sel.advantage_mask(gated=False, group_size=2) == [1.0] * 8


def test_full_first_round_needs_no_refill():
    rounds = [[True, True, True]]
    assert gv.shortfall(rounds, 3) == 0
    sel = gv.select(rounds, 3)
    assert (sel.kept, sel.filled, sel.sampled, sel.dropped) == ([(0, 0), (0, 1), (0, 2)], [], 3, 0)


def test_no_variance_anywhere_trains_on_the_first_round():
    sel = gv.select([[False, False], [False, False], [False]], 2)
    assert sel.kept == [] and sel.filled == [(0, 0), (0, 1)] and sel.dropped == sel.sampled == 5
    assert sel.advantage_mask(True, 3) == [0.0] * 6


def test_refill_draw_is_seeded_by_step_and_covers_the_dataset():
    a = gv.RefillDraw(5, seed=0, step=7)
    first = a.take(3) + a.take(2)
    assert sorted(first) == [0, 1, 2, 3, 4]  # a permutation before any repeat
    assert sorted(a.take(5)) == [0, 1, 2, 3, 4]
    again = gv.RefillDraw(5, seed=0, step=7)
    assert again.take(5) == first  # a resumed run draws the same prompts at the same step
    others = [gv.RefillDraw(5, seed=0, step=s).take(5) for s in range(8, 12)]
    assert any(o != first for o in others)


def test_merge_rows_pads_each_side_and_recounts_tokens():
    import torch

    a = {"prompt_ids": torch.tensor([[5, 6], [7, 8]]), "prompt_mask": torch.ones(2, 2, dtype=torch.long),
         "completion_ids": torch.tensor([[1, 2, 3], [4, 9, 9]]),
         "completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
         "advantages": torch.tensor([0.5, -0.5]), "num_items_in_batch": torch.tensor(4)}
    b = {"prompt_ids": torch.tensor([[3, 5, 6]]), "prompt_mask": torch.ones(1, 3, dtype=torch.long),
         "completion_ids": torch.tensor([[2]]), "completion_mask": torch.tensor([[1]]),
         "advantages": torch.tensor([2.0]), "num_items_in_batch": torch.tensor(1)}
    m = gv.merge_rows([a, b], [(1, [0]), (0, [1])], pad_token_id=0)
    assert m["prompt_ids"].tolist() == [[3, 5, 6], [0, 7, 8]]  # prompts left-padded
    assert m["prompt_mask"].tolist() == [[1, 1, 1], [0, 1, 1]]
    assert m["completion_ids"].tolist() == [[2, 0, 0], [4, 9, 9]]  # completions right-padded
    assert m["completion_mask"].tolist() == [[1, 0, 0], [1, 0, 0]]
    assert m["advantages"].tolist() == [2.0, -0.5] and int(m["num_items_in_batch"]) == 2
    with pytest.raises(SlmsqlError, match=r"holding \['pixel_values'\]"):
        gv.merge_rows([{**a, "pixel_values": torch.zeros(2, 1)}], [(0, [0])], 0)


def test_correctness_hook_takes_exactly_one_scoring():
    hook = gv.Correctness()
    hook([type("O", (), {"correct": c})() for c in (True, False)])
    assert hook.take(2) == [True, False]
    with pytest.raises(RuntimeError, match="one execution scoring of 2 completions, got \\[\\]"):
        hook.take(2)


@pytest.mark.parametrize("over, message", [
    ({"advantage_gate": "correctness", "rewards": "format"}, "--advantage-gate correctness needs the execution"),
    ({"dynamic_sampling": True, "max_resample_rounds": -1}, "max_resample_rounds must be >= 0"),
])
def test_option_sets_no_run_could_use_are_refused(over, message):
    with pytest.raises(SlmsqlError, match=message):
        gv.check(configs.load(configs.GRPOStageConfig, None, over))


def test_stage_refuses_before_any_model_loads(shop, tmp_path, monkeypatch):
    from slmsql.policy import models
    from slmsql.stages import grpo

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_model", refuse)
    data = write(tmp_path / "gold.jsonl", [{"id": "q1", "db_id": "shop", "question": "Names?",
                                           "sql": "SELECT name FROM item"}])
    cfg = configs.load(configs.GRPOStageConfig, None, {
        "data": str(data), "db_root": str(shop), "output_dir": str(tmp_path / "out"), "rewards": "format",
        "advantage_gate": "correctness"})
    with pytest.raises(SlmsqlError, match="needs the execution reward"):
        grpo.main(cfg)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_dynamic_sampling_is_single_process():
    cfg = configs.load(configs.GRPOStageConfig, None, {"dynamic_sampling": "true"})
    with pytest.raises(SlmsqlError, match="one process only"):
        gv.check(cfg, world_size=2)
    gv.check(configs.load(configs.GRPOStageConfig, None, {"advantage_gate": "correctness"}), world_size=2)


# ---- real toy runs, on scripted completions ------------------------------------------------------------
# What these runs need of sampling (all-wrong groups whose shaped rewards vary; groups with and without
# correctness variance) is scripted (tests/scripted.py), not hoped for from the tiny policy's sampler.


def wrong_mix(_prompt, i):
    return (scripted.WRONG, scripted.NO_SQL)[i % 2]  # all wrong; shaped rewards 0.3 and 0.0 in every group


@pytest.fixture(scope="module")
def toy_runs(policy, tmp_path_factory):
    """Two 2-step `slmsql grpo` runs on the tiny policy, in one store:
    gate: the correctness gate, every completion wrong (runs-but-wrong ```sql blocks and no SQL, alternating);
    dynamic: dynamic sampling + the gate on 2 questions, A (one of its 4 completions right) and B (all wrong)."""
    from slmsql.stages import grpo

    root = tmp_path_factory.mktemp("variants")
    rows = read(policy.train)
    a, b = rows[0], rows[1]
    data = {"gate": write(root / "gate.jsonl", rows[:8]), "dynamic": write(root / "mixed.jsonl", [a, b])}
    find = scripted.question_of([a, b])
    answers = {"gate": wrong_mix,
               "dynamic": lambda p, i: scripted.right(a) if find(p) is a and i == 0 else wrong_mix(p, i)}
    options = {"gate": {"advantage_gate": "correctness"},
               "dynamic": {"advantage_gate": "correctness", "dynamic_sampling": True, "max_resample_rounds": 2}}
    out = {}
    with tracking_store(f"sqlite:///{root}/mlflow.db") as uri, pytest.MonkeyPatch.context() as mp:
        client = mlflow.MlflowClient(uri)
        for name, opts in options.items():
            scripted.install(mp, policy.model, answers[name], group=4)
            cfg = configs.load(configs.GRPOStageConfig, None, {
                "data": str(data[name]), "db_root": str(policy.db_root), "model": str(policy.model),
                "output_dir": str(root / name), "experiment": name, "num_generations": 4,
                "per_device_train_batch_size": 8, "max_completion_length": 32, "max_steps": 2, "save_steps": 100,
                "completions_every": 1, "workers": 1, "timeout_s": 2.0, "lora_r": 8, "lora_alpha": 16, **opts})
            grpo.main(cfg)
            (run,) = client.search_runs([client.get_experiment_by_name(name).experiment_id])
            history = {k: [h.value for h in sorted(client.get_metric_history(run.info.run_id, k),
                                                   key=lambda h: h.step)] for k in run.data.metrics}
            out[name] = (cfg, run, history, client)
    return out


def completions(cfg, step: int):
    import pandas as pd

    return pd.read_parquet(Path(cfg.output_dir) / "completions" / f"completions_{step:05d}.parquet")


def test_gate_on_all_wrong_groups_moves_nothing(toy_runs):
    cfg, run, m, _ = toy_runs["gate"]
    assert run.data.params["advantage_gate"] == "correctness" and run.data.params["dynamic_sampling"] == "false"
    # TRL alone would push: the shaped rewards (0.3 and 0.0) vary within every group
    assert m["frac_reward_zero_std"] == [0.0, 0.0] and m["exec/correct"] == [0.0, 0.0]
    assert m["loss"] == [0.0, 0.0] and m["grad_norm"] == [0.0, 0.0]
    assert weight_change(Path(cfg.output_dir) / "adapter") == 0.0  # every LoRA B still zero
    assert m["advantage_gate/frac_groups_zeroed"] == [1.0, 1.0]
    for step in (1, 2):
        table = completions(cfg, step)
        assert (table["advantage"] == 0).all() and len(table) == 8


def test_dynamic_sampling_counts_and_learns(toy_runs):
    cfg, run, m, client = toy_runs["dynamic"]
    assert run.data.params["dynamic_sampling"] == "true" and run.data.params["max_resample_rounds"] == "2"
    ds = {k: m[f"dynamic_sampling/{k}"] for k in ("groups_sampled", "groups_kept", "groups_dropped",
                                                 "groups_filled", "extra_rounds")}
    assert all(len(v) == 2 for v in ds.values())  # one value per step
    # Each step's first round holds both questions: A kept, B dropped, one group short. A refill round draws
    # one question from a permutation of the two: A (kept, done) or B (dropped again; the next round draws A).
    for s, k, d, f, r in zip(*ds.values()):
        assert k + d == s and k + f == 2  # every sampled group kept or dropped; the batch is always 2 groups
        assert (k, f) == (2, 0) and r in (1, 2) and d == r and s == 2 + r
    # the completions table is the batch trained on: kept groups (correctness varies) with TRL's advantages,
    # topped-up groups at 0 (the gate is on)
    for step in (1, 2):
        table = completions(cfg, step)
        assert len(table) == 8
        rewards = (table["execution"] + table["format"]).tolist()
        varying = gv.groups_varying((table["status"] == "correct").tolist(), 4)
        assert sum(varying) == ds["groups_kept"][step - 1]
        expected = trl_advantages(rewards, 4)
        for g, v in enumerate(varying):
            rows = slice(4 * g, 4 * g + 4)
            want = expected[rows] if v else [0.0] * 4
            assert table["advantage"].tolist()[rows] == pytest.approx(want, abs=1e-4)
    # it learned from the batches with correctness variance: LoRA B off zero, grad_norm > 0, logits moved
    assert_learned(cfg.output_dir, run.info.run_id, cfg.model, prompt_for(cfg), client=client)
