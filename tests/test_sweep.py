"""slmsql sweep: the grid, the pooled table with Holm's adjustment, and one small real sweep (marked slow)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from policy import policy_fixture, read, tracking_store, write  # noqa: F401  (the fixture)
from scipy import stats as scipy_stats

from slmsql import configs
from slmsql.stats import seedstats, inference as stats
from slmsql.cli import main as cli
from slmsql.configs import SweepConfig, Variant, param_text
from slmsql.errors import DataError
from slmsql.stages import sweep


# ---- the grid ------------------------------------------------------------------------------------------

def labels(grid: str) -> list[str]:
    return [v.label for v in configs.parse_grid(grid)]


def test_grid_axes_multiply_and_groups_add_up():
    got = configs.parse_grid("runs_tier=0.1,0 learning_rate=1e-3,1e-4")
    assert [v.settings for v in got] == [
        {"runs_tier": 0.1, "learning_rate": 1e-3}, {"runs_tier": 0.1, "learning_rate": 1e-4},
        {"runs_tier": 0.0, "learning_rate": 1e-3}, {"runs_tier": 0.0, "learning_rate": 1e-4}]
    # the study's shape: groups add up, `defaults` changes nothing, two fields set together in one variant
    study = configs.parse_grid("defaults; runs_tier=0 format_tier=0; use_lora=false,true")
    assert [v.settings for v in study] == [{}, {"runs_tier": 0.0, "format_tier": 0.0}, {"use_lora": False},
                                           {"use_lora": True}]
    assert [v.label for v in study] == ["defaults", "runs_tier=0.0 format_tier=0.0", "use_lora=false",
                                        "use_lora=true"]
    assert configs.parse_grid("") == [Variant("defaults", {})]  # seeds alone: the GRPO config as it is


def test_grid_list_fields_and_trainer_args():
    got = configs.parse_grid("rewards=execution+format,execution trainer_args.loss_type=dapo")
    assert [v.settings for v in got] == [{"rewards": ["execution", "format"], "trainer_args": {"loss_type": "dapo"}},
                                         {"rewards": ["execution"], "trainer_args": {"loss_type": "dapo"}}]
    assert labels("reward_weights=1+0.5") == ["reward_weights=1.0+0.5"]


@pytest.mark.parametrize("grid, match", [
    ("runs_teir=0.1,0", r"--grid: field 'runs_teir': no such GRPO option; known: \[.*'runs_tier'"),
    ("runs_tier=0.1,lots", r"--grid: field 'runs_tier': expected float, got 'lots'"),
    ("max_steps=2.5", r"field 'max_steps': expected int"),
    ("adapter_mode=merge", r"field 'adapter_mode': must be one of \['continue', 'stack'\]"),
    ("use_lora=maybe", r"field 'use_lora': expected bool"),
    ("seed=1,2", r"field 'seed': set by --seeds"),
    ("data=a.jsonl", r"field 'data': set by --data"),
    ("trainer_args=loss_type=dapo", r"field 'trainer_args': vary one TRL field at a time"),
    ("runs_tier=0.1,0.1", r"field 'runs_tier': a value is given twice"),
    ("runs_tier=0 runs_tier=1", r"field 'runs_tier': axis given twice"),
    ("runs_tier=", r"field 'runs_tier': no values"),
    ("runs_tier", r"expected FIELD=v1,v2"),
    ("defaults;;runs_tier=0", r"empty variant group"),
    ("runs_tier=0; runs_tier=0.0", r"variant\(s\) \['runs_tier=0.0'\] given more than once"),
])
def test_bad_grid_names_the_field(grid, match):
    with pytest.raises(DataError, match=match):
        configs.parse_grid(grid)
    with pytest.raises(DataError, match=match):  # the config refuses it as it is built
        SweepConfig(grid=grid)


def test_cli_bad_grid_exits_before_any_run(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["sweep", "--grid", "runs_teir=0.1", "--output-dir", str(tmp_path / "out")])
    assert result.exit_code == 2 and "error: --grid: field 'runs_teir': no such GRPO option" in result.output
    assert not (tmp_path / "out").exists()
    assert mlflow.MlflowClient().get_experiment_by_name("slmsql") is None


def test_plan_refuses_what_would_not_run_as_asked(tmp_path):
    (tmp_path / "dbs").mkdir()
    rl = write(tmp_path / "rl.jsonl", [])
    dev = write(tmp_path / "dev.jsonl", [])
    base = dict(data=str(rl), db_root=str(tmp_path / "dbs"), eval_data=[str(dev)], model="m")
    sweep.plan(SweepConfig(**base))  # the good case plans
    cases = [
        (dict(grid="defaults; runs_tier=0.1"), "variants 'defaults' and 'runs_tier=0.1' are the same GRPO config"),
        (dict(grid="runs_tier=0,0.1", overrides={"grpo.runs_tier": 0.3}), "field 'grpo.runs_tier': also an axis"),
        (dict(overrides={"grpo.seed": 3}), "field 'grpo.seed': set by --seeds"),
        (dict(overrides={"evaluate.adapter": "x"}), "field 'evaluate.adapter': set by the sweep"),
        (dict(overrides={"filter.k": 4}), "field 'filter.k': expected grpo.FIELD or evaluate.FIELD"),
        (dict(overrides={"grpo.lerning_rate": 1}), "field 'grpo.lerning_rate'"),
        (dict(eval_names=["a", "b"]), "field 'eval_names': 2 given for 1 eval files"),
        (dict(baseline_runs=["r1", "r2"]), "field 'baseline_runs': 2 given for 1 eval files"),
        (dict(eval_data=[str(dev), str(dev)]), "eval set names must differ"),
        (dict(eval_data=[str(tmp_path / "nope.jsonl")]), "nope.jsonl: field 'eval_data': no such file"),
        (dict(base_adapter=str(tmp_path / "no-adapter")), "no such adapter folder"),
    ]
    for change, match in cases:
        with pytest.raises(Exception, match=match):
            sweep.plan(SweepConfig(**{**base, **change}))
    with pytest.raises(Exception, match="adapter_mode=stack with --base-adapter"):
        (tmp_path / "adapter").mkdir()
        sweep.plan(SweepConfig(**base, base_adapter=str(tmp_path / "adapter"), grid="adapter_mode=continue,stack"))


def test_plan_resolves_recipe_overrides_and_grid(tmp_path):
    (tmp_path / "dbs").mkdir()
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text("learning_rate: 1.0e-5\nmax_steps: 7\nruns_tier: 0.3\ntrainer_args: {warmup_ratio: 0.1}\n")
    cfg = SweepConfig(data=str(write(tmp_path / "rl.jsonl", [])), db_root=str(tmp_path / "dbs"), model="m",
                      eval_data=[str(write(tmp_path / "dev.jsonl", []))], grpo_recipe=str(recipe),
                      grid="defaults; runs_tier=0.1 trainer_args.loss_type=dapo",
                      overrides={"grpo.max_steps": 2, "evaluate.batch_size": 4})
    p = sweep.plan(cfg)
    plain, varied = p.grpo["defaults"], p.grpo["runs_tier=0.1 trainer_args.loss_type=dapo"]
    assert (plain.learning_rate, plain.max_steps, plain.runs_tier) == (1e-5, 2, 0.3)  # recipe < overrides
    assert varied.runs_tier == 0.1  # a grid value equal to the field's default still beats the recipe
    assert varied.trainer_args == {"warmup_ratio": 0.1, "loss_type": "dapo"}
    assert p.evaluate.batch_size == 4 and [e.name for e in p.eval_sets] == ["dev"] and p.seeds == [0, 1, 2]
    assert plain.data == str((tmp_path / "rl.jsonl").resolve())  # steps run in the project folder


# ---- the pooled table and Holm's adjustment ------------------------------------------------------------

def test_holm_textbook_example():
    # Holm (1979) as in the standard worked example: p = 0.01, 0.04, 0.03, 0.005 at alpha 0.05. Ascending:
    # 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> 0.06 (adjusted p never decreases).
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.5, 0.6]) == [1.0, 1.0]  # capped at 1
    assert stats.holm([]) == []
    with pytest.raises(stats.StatsError):
        stats.holm([0.2, math.nan])


def reference_holm(p: list[float]) -> list[float]:
    """Holm's step-down adjustment written out, to check the table against."""
    order = sorted(range(len(p)), key=lambda i: p[i])
    out, running = [0.0] * len(p), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        out[i] = running
    return out


def test_report_pools_seeds_and_adjusts_over_the_table():
    rng = np.random.default_rng(1)
    n, ids = 60, [f"q{i}" for i in range(60)]
    baseline = {"dev": rng.random(n) < 0.4, "cross": rng.random(n) < 0.3}
    # variant "up": each seed flips many wrong answers right; "same": a seed's noise around the baseline
    shift = {"up": 0.45, "same": 0.05}
    plan = sweep.Plan([Variant("up", {"runs_tier": 0.0}), Variant("same", {})], {}, None,
                      [sweep.EvalSet("dev", "", ""), sweep.EvalSet("cross", "", "")], [0, 1, 2])
    correct = {f"base-{e}": dict(zip(ids, map(bool, b))) for e, b in baseline.items()}
    cells, runs = [], {}
    for v in ("up", "same"):
        for seed in plan.seeds:
            evals = {}
            for e, b in baseline.items():
                flip = rng.random(n) < shift[v]
                got = np.where(flip, ~b if v == "same" else True, b)
                runs[(v, e, seed)] = got
                evals[e] = f"{v}-{e}-{seed}"
                correct[evals[e]] = dict(zip(ids, map(bool, got)))
            cells.append({"variant": v, "seed": seed, "grpo_run": f"g-{v}-{seed}", "eval_runs": evals,
                          "baseline_runs": {e: f"base-{e}" for e in baseline}, "reused": False})
    rep = sweep.report(plan, cells, correct, alpha=0.05)
    assert [(r["variant"], r["eval_set"]) for r in rep["rows"]] == [
        ("up", "dev"), ("up", "cross"), ("same", "dev"), ("same", "cross")]
    for r in rep["rows"]:
        seeds = [runs[(r["variant"], r["eval_set"], s)] for s in plan.seeds]
        ex = [float(np.mean(x)) for x in seeds]
        d = np.mean(seeds, axis=0) - baseline[r["eval_set"]]
        assert r["ex_seeds"] == pytest.approx(ex) and r["ex_mean"] == pytest.approx(np.mean(ex))
        assert r["ex_sd"] == pytest.approx(np.std(ex, ddof=1)) and (r["ex_min"], r["ex_max"]) == (min(ex), max(ex))
        assert r["diff"] == pytest.approx(d.mean())
        assert r["p"] == pytest.approx(scipy_stats.ttest_1samp(d, 0).pvalue)  # per question, seeds pooled
    p_raw = [r["p"] for r in rep["rows"]]
    assert [r["p_holm"] for r in rep["rows"]] == pytest.approx(reference_holm(p_raw))
    assert rep["comparisons"] == 4
    for r in rep["rows"]:
        assert r["verdict"] == ("no significant difference" if r["p_holm"] >= 0.05 else
                                "improved" if r["diff"] > 0 else "regressed")
    assert [r["verdict"] for r in rep["rows"]][:2] == ["improved", "improved"]
    # significant alone (p 0.033, its own interval above 0), not after trying 4 comparisons (Holm p 0.065)
    same_cross = rep["rows"][3]
    assert same_cross["p"] < 0.05 <= same_cross["p_holm"] and same_cross["diff_ci_low"] > 0
    assert same_cross["verdict"] == "no significant difference"
    # the table logged to MLflow: one row per variant, one column group per eval set
    table = sweep.wide_table(rep)
    assert list(table["variant"]) == ["up", "same"]
    assert list(table.columns) == ["variant", "seeds"] + [f"{e}/{k}" for e in ("dev", "cross") for k in sweep.ROW_KEYS]
    md = sweep.markdown(rep)
    assert "| up | " in md and "**dev** (n = 60" in md and "Holm over all 4 comparisons" in md
    json.dumps(rep, allow_nan=False)  # valid JSON


def test_report_of_one_seed_has_no_sd():
    plan = sweep.Plan([Variant("defaults", {})], {}, None, [sweep.EvalSet("dev", "", "")], [0])
    correct = {"b": {"q1": True, "q2": False, "q3": False}, "e": {"q1": True, "q2": True, "q3": False}}
    cells = [{"variant": "defaults", "seed": 0, "grpo_run": "g", "eval_runs": {"dev": "e"},
              "baseline_runs": {"dev": "b"}, "reused": False}]
    rep = sweep.report(plan, cells, correct, 0.05)
    [row] = rep["rows"]
    assert row["ex_sd"] is None and row["ex_mean"] == pytest.approx(2 / 3) and row["seeds"] == 1
    # every question moved alike: the t statistic is infinite, written as null (JSON has no inf)
    correct["e"] = {"q1": True, "q2": True, "q3": True}
    correct["b"] = {"q1": False, "q2": False, "q3": False}
    [row] = sweep.report(plan, cells, correct, 0.05)["rows"]
    assert row["t"] is None and row["p"] == 0 and row["verdict"] == "improved"
    json.dumps(rep, allow_nan=False)


def test_report_shows_the_method_verdict_where_it_differs_from_the_seeds():
    """Three seeds that moved by +24, +2 and +12 points on 200 questions: together they beat the start (pooled
    test, questions random: a verdict for these seeds), but a method whose seeds spread that much is not shown
    to help (seeds random too, seedstats.over_seeds; df ~2). The row carries both, and the table says where they
    differ; the method's p gets its own Holm over the same comparisons."""
    n, ids = 200, [f"q{i}" for i in range(200)]
    base = np.zeros(n, dtype=bool)
    base[:100] = True
    runs = []
    for gain in (48, 4, 24):  # questions turned right (of the 100 the start gets wrong): +24, +2, +12 points
        run = base.copy()
        run[100:100 + gain] = True
        runs.append(run)
    plan = sweep.Plan([Variant("defaults", {})], {}, None, [sweep.EvalSet("dev", "", "")], [0, 1, 2])
    correct = {"b": dict(zip(ids, map(bool, base))), **{f"e{s}": dict(zip(ids, map(bool, r))) for s, r in
                                                          enumerate(runs)}}
    cells = [{"variant": "defaults", "seed": s, "grpo_run": f"g{s}", "eval_runs": {"dev": f"e{s}"},
              "baseline_runs": {"dev": "b"}, "reused": False} for s in range(3)]
    rep = sweep.report(plan, cells, correct, 0.05)
    [row] = rep["rows"]
    ref = seedstats.over_seeds(runs, base)
    assert (row["seed_diff_ci_low"], row["seed_diff_ci_high"], row["seed_p"], row["seed_df"]) == pytest.approx(
        (ref["diff_ci_low"], ref["diff_ci_high"], ref["p"], ref["df"]))
    assert row["var_seed"] == pytest.approx(np.var([0.24, 0.02, 0.12], ddof=1) - row["var_within"] / n)
    assert row["verdict"] == "improved" and row["p"] < 0.001
    assert row["seed_verdict"] == "no significant difference" and row["seed_diff_ci_low"] < 0 < row["seed_p"] - 0.05
    assert row["seed_p_holm"] == row["seed_p"]  # a family of one
    md = sweep.markdown(rep)
    assert "Over seeds" in md and "| no significant difference (pooled: improved) |" in md
    json.dumps(rep, allow_nan=False)
    one = sweep.report(dataclasses.replace(plan, seeds=[0]), cells[:1], correct, 0.05)
    [row] = one["rows"]  # one seed: no method inference, and no table for it
    assert row["seed_p"] is row["seed_verdict"] is row["var_seed"] is None and row["var_within"] == 0
    assert row["var_question"] == pytest.approx(np.var((runs[0].astype(float) - base), ddof=1))
    assert "Over seeds" not in sweep.markdown(one)


def test_start_axis_trains_every_variant_from_each_start_on_its_own_data(tmp_path):
    (tmp_path / "dbs").mkdir()
    bands = [str(write(tmp_path / f"band-{x}.jsonl", [])) for x in ("weak", "demo")]
    base = dict(data=bands, db_root=str(tmp_path / "dbs"), eval_data=[str(write(tmp_path / "dev.jsonl", []))],
                model=["runs:/w/policy", "runs:/d/policy"], start_names=["weak", "demo"],
                grid="max_steps=50; max_steps=400 learning_rate=5e-4")
    p = sweep.plan(SweepConfig(**base))
    assert [v.label for v in p.variants] == [
        "start=weak max_steps=50", "start=weak max_steps=400 learning_rate=0.0005",
        "start=demo max_steps=50", "start=demo max_steps=400 learning_rate=0.0005"]
    got = {label: (c.model, c.data, c.max_steps, c.learning_rate) for label, c in p.grpo.items()}
    lr = configs.GRPOStageConfig().learning_rate
    assert got["start=weak max_steps=50"] == ("runs:/w/policy", str(Path(bands[0]).resolve()), 50, lr)
    assert got["start=demo max_steps=400 learning_rate=0.0005"] == ("runs:/d/policy", str(Path(bands[1]).resolve()),
                                                                     400, 5e-4)
    assert {label: st.name for label, st in p.start_of.items()} == {v.label: v.label.split()[0][6:] for v in p.variants}
    # one RL file serves every start; the names default to each path's last part
    one = sweep.plan(SweepConfig(**{**base, "data": bands[:1], "start_names": [], "model": ["a/weak", "b/demo"]}))
    assert [s.name for s in one.starts] == ["weak", "demo"] and {s.data for s in one.starts} == {bands[0]}
    # one start: the labels stay the grid's (the toy study's table is unchanged)
    assert [v.label for v in sweep.plan(SweepConfig(**{**base, "model": ["m"], "data": bands[:1],
                                                       "start_names": []})).variants] == ["max_steps=50",
                                                                                          "max_steps=400 learning_rate=0.0005"]
    for change, match in [
        (dict(start_names=["weak"]), "field 'start_names': 1 given for 2 --model"),
        (dict(data=bands + bands[:1]), "field 'data': 3 given for 2 --model"),
        (dict(base_adapter=["x"]), "field 'base_adapter': 1 given for 2 --model"),
        (dict(start_names=["a", "a"]), "field 'start_names': start names must differ"),
        (dict(start_names=[], model=["x/policy", "y/policy"]), "start names must differ"),
        (dict(baseline_runs=["r1"]), "field 'baseline_runs': one per eval set is for one start"),
    ]:
        with pytest.raises(DataError, match=match):
            sweep.plan(SweepConfig(**{**base, **change}))


def test_start_axis_compares_each_row_with_its_own_start_in_one_holm_family():
    ids = [f"q{i}" for i in range(40)]
    # the weak start gets 10 of 40 right and GRPO lifts it to 30; the strong one starts at 30 and stays there
    weak, strong = [i < 10 for i in range(40)], [i < 30 for i in range(40)]
    lifted = [i < 30 for i in range(40)]
    starts = [sweep.Start("weak", "w", "", "bw"), sweep.Start("demo", "d", "", "bd")]
    variants = [Variant(f"start={s.name} defaults", {}) for s in starts]
    plan = sweep.Plan(variants, {}, None, [sweep.EvalSet("dev", "", "")], [0, 1], starts,
                      dict(zip([v.label for v in variants], starts)))
    correct = {"bw": dict(zip(ids, weak)), "bd": dict(zip(ids, strong))}
    cells = []
    for v, st in zip(variants, starts):
        for seed in plan.seeds:
            correct[f"{st.name}-{seed}"] = dict(zip(ids, lifted))
            cells.append({"variant": v.label, "seed": seed, "grpo_run": f"g-{st.name}-{seed}",
                          "eval_runs": {"dev": f"{st.name}-{seed}"}, "baseline_runs": {"dev": f"b{st.name[0]}"},
                          "reused": False})
    rep = sweep.report(plan, cells, correct, alpha=0.05)
    w, d = rep["rows"]
    assert (w["start"], w["ex_b"], w["diff"], w["verdict"]) == ("weak", 0.25, 0.5, "improved")
    assert (d["start"], d["ex_b"], d["diff"], d["verdict"]) == ("demo", 0.75, 0.0, "no significant difference")
    assert rep["comparisons"] == 2 and [r["p_holm"] for r in rep["rows"]] == pytest.approx(
        reference_holm([w["p"], d["p"]]))
    assert rep["starts"] == [{"name": "weak", "baseline_runs": {"dev": "bw"}},
                             {"name": "demo", "baseline_runs": {"dev": "bd"}}]
    md = sweep.markdown(rep)
    assert "| variant | start EX | EX mean |" in md and "| start=weak defaults | 25.0% | 75.0% |" in md
    assert "starting policy EX" not in md  # no one start's EX heads a table of two starts



def test_each_start_has_an_eval_set_of_its_own(tmp_path):
    (tmp_path / "dbs").mkdir()
    bands = [str(write(tmp_path / f"band-{x}.jsonl", [])) for x in ("weak", "demo")]
    base = dict(data=bands, db_root=str(tmp_path / "dbs"), eval_data=[str(write(tmp_path / "dev.jsonl", []))],
                eval_names=["dev"], model=["w", "d"], start_names=["weak", "demo"], grid="max_steps=50,200",
                start_eval_data=bands, start_eval_name="band-seen")
    p = sweep.plan(SweepConfig(**base))
    got = {label: [(es.name, es.data) for es in p.sets_of(st)] for label, st in p.start_of.items()}
    dev = ("dev", str((tmp_path / "dev.jsonl").resolve()))
    for label, sets in got.items():  # the shared set, then the start's own band, under the one name
        own = bands[0] if label.startswith("start=weak ") else bands[1]
        assert sets == [dev, ("band-seen", str(Path(own).resolve()))], label
    assert p.eval_sets == [sweep.EvalSet(*dev, str((tmp_path / "dbs").resolve()))]  # not a shared set
    assert [st.eval_set for st in p.starts] == [p.start_of[f"start={st.name} max_steps=50"].eval_set
                                                 for st in p.starts]
    bare = sweep.plan(SweepConfig(**{**base, "start_eval_data": []}))  # none given: the shared sets alone
    assert [bare.sets_of(st) for st in bare.starts] == [p.eval_sets] * 2
    for change, match in [
        (dict(start_eval_data=bands[:1]), "field 'start_eval_data': 1 given for 2 --model: give one per --model"),
        (dict(start_eval_data=bands + bands[:1]), "field 'start_eval_data': 3 given for 2 --model"),
        (dict(start_eval_name="dev"), "field 'start_eval_name': needs a name that no --eval-names has"),
        (dict(start_eval_name=""), "field 'start_eval_name'"),
        (dict(start_eval_data=[bands[0], str(tmp_path / "nope.jsonl")]),
         "nope.jsonl: field 'start_eval_data': no such file"),
    ]:
        with pytest.raises(DataError, match=match):
            sweep.plan(SweepConfig(**{**base, **change}))


def test_own_eval_sets_are_compared_with_their_own_start_in_the_one_family():
    dev, weak_band, demo_band = ([f"{x}{i}" for i in range(n)] for x, n in (("q", 40), ("w", 20), ("d", 30)))
    starts = [sweep.Start("weak", "w", "", "bw", sweep.EvalSet("band", "bw.jsonl", "")),
              sweep.Start("demo", "d", "", "bd", sweep.EvalSet("band", "bd.jsonl", ""))]
    variants = [Variant(f"start={s.name} defaults", {}) for s in starts]
    plan = sweep.Plan(variants, {}, None, [sweep.EvalSet("dev", "", "")], [0, 1], starts,
                      dict(zip([v.label for v in variants], starts)))
    # on its band the weak start goes 5/20 -> 15/20; the demo start is 15/30 before and after; dev moves nowhere
    correct = {"w-dev": {q: q < "q20" for q in dev}, "d-dev": {q: q < "q20" for q in dev},
               "w-band": {q: int(q[1:]) < 5 for q in weak_band}, "d-band": {q: int(q[1:]) < 15 for q in demo_band}}
    cells = []
    for v, st in zip(variants, starts):
        for seed in plan.seeds:
            run = f"{st.name}-{seed}"
            correct[f"{run}-dev"] = correct[f"{st.name[0]}-dev"]
            correct[f"{run}-band"] = ({q: int(q[1:]) < 15 for q in weak_band} if st.name == "weak"
                                      else correct["d-band"])
            cells.append({"variant": v.label, "seed": seed, "grpo_run": f"g-{run}", "reused": False,
                          "eval_runs": {"dev": f"{run}-dev", "band": f"{run}-band"},
                          "baseline_runs": {"dev": f"{st.name[0]}-dev", "band": f"{st.name[0]}-band"}})
    rep = sweep.report(plan, cells, correct, alpha=0.05)
    rows = {(r["start"], r["eval_set"]): r for r in rep["rows"]}
    assert rep["comparisons"] == 4 and [r["p_holm"] for r in rep["rows"]] == pytest.approx(
        reference_holm([r["p"] for r in rep["rows"]]))
    assert (rows["weak", "band"]["n"], rows["weak", "band"]["ex_b"], rows["weak", "band"]["diff"],
            rows["weak", "band"]["verdict"]) == (20, 0.25, 0.5, "improved")
    assert (rows["demo", "band"]["n"], rows["demo", "band"]["ex_b"], rows["demo", "band"]["diff"],
            rows["demo", "band"]["verdict"]) == (30, 0.5, 0.0, "no significant difference")
    assert [es["name"] for es in rep["eval_sets"]] == ["dev", "band"]
    assert rep["eval_sets"][1]["n"] == "weak 20, demo 30" and rep["eval_sets"][0]["n"] == 40
    assert "**band** (n = weak 20, demo 30)" in sweep.markdown(rep)
    assert rep["starts"][1] == {"name": "demo", "baseline_runs": {"dev": "d-dev", "band": "d-band"}}


class _FakeSteps:
    """The sweep's steps, recorded instead of run: each evaluate 'run' scores every question of its file right."""

    def __init__(self, experiment_id, output_dir, **_):
        self.out, self.reused, self.calls = Path(output_dir), [], []
        _FakeSteps.last = self

    def run(self, stage, name, tags=None, **params):
        import types

        run_id = f"r{len(self.calls)}"
        self.calls.append((stage, {**params, "run_id": run_id}))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id), params=params)

    def uri(self, run, name):
        return f"runs:/{run.info.run_id}/{name}"

    def artifact(self, run, name):
        rows = read(run.params["data"])
        path = self.out / f"{run.info.run_id}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path, [{"id": r["id"], "correct": run.params.get("adapter", "") != ""} for r in rows])
        return path


def test_sweep_scores_each_starts_cells_on_its_own_file(tmp_path, monkeypatch):
    from slmsql.workflow import steps as workflow

    (tmp_path / "dbs").mkdir()
    files = {x: str(write(tmp_path / f"{x}.jsonl", [{"id": f"{x}{i}"} for i in range(n)]))
             for x, n in (("dev", 12), ("band-weak", 8), ("band-demo", 10))}
    monkeypatch.setattr(workflow, "Steps", _FakeSteps)
    w, d = (str(tmp_path / "starts" / x) for x in ("w", "d"))  # local starting policies, only looked at
    rep = sweep.main(SweepConfig(model=[w, d], start_names=["weak", "demo"], data=[files["band-weak"]],
                                 db_root=str(tmp_path / "dbs"), eval_data=[files["dev"]], eval_names=["dev"],
                                 start_eval_data=[files["band-weak"], files["band-demo"]], seeds=2,
                                 start_eval_name="band-seen", output_dir=str(tmp_path / "out")))
    evals = [p for stage, p in _FakeSteps.last.calls if stage == "evaluate"]
    seen = {(Path(p["model"]).name, bool(p["adapter"]), Path(p["data"]).name) for p in evals
            if p["dataset_name"] == "band-seen"}
    # each start and its 2 cells scored on its own band, never on the other start's
    assert seen == {("w", False, "band-weak.jsonl"), ("w", True, "band-weak.jsonl"),
                    ("d", False, "band-demo.jsonl"), ("d", True, "band-demo.jsonl")}
    assert sum(p["dataset_name"] == "band-seen" for p in evals) == 2 * (1 + 2)
    base = {(p["model"], p["dataset_name"]): p for p in evals if not p["adapter"]}
    for p in evals:  # every cell's evaluation is compared with its own start's run on that file
        if p["adapter"]:
            assert p["baseline_run"] == base[p["model"], p["dataset_name"]]["run_id"]
    rows = {(r["start"], r["eval_set"]): r["n"] for r in rep["rows"]}
    assert rows == {("weak", "dev"): 12, ("demo", "dev"): 12, ("weak", "band-seen"): 8, ("demo", "band-seen"): 10}
    assert rep["comparisons"] == 4


# ---- one small real sweep: 2 variants x 2 seeds, 2 GRPO steps each, a 12-question dev slice ----------------

SMALL = ("grpo.max_steps=2 grpo.num_generations=4 grpo.per_device_train_batch_size=8 grpo.max_completion_length=32 "
         "grpo.save_steps=2 grpo.completions_every=2 grpo.workers=1 grpo.lora_r=8 grpo.lora_alpha=16 "
         "evaluate.workers=1 evaluate.max_new_tokens=48")


def _args(policy, root: Path) -> list[str]:
    return ["sweep", "--grid", "runs_tier=0.1,0", "--seeds", "2", "--model", str(policy.model),
            "--data", str(root / "band.jsonl"), "--db-root", str(policy.db_root),
            "--eval-data", str(root / "dev-slice.jsonl"), "--eval-names", "dev-slice", "--output-dir",
            str(root / "out"), "--overrides", SMALL]


@pytest.fixture(scope="module")
def small_sweep(policy, tmp_path_factory):
    import mlflow

    from slmsql.stages import sweep as stage

    root = tmp_path_factory.mktemp("sweep")
    write(root / "band.jsonl", [{**r, "pass_rate": 0.5} for r in read(policy.train)[:8]])
    write(root / "dev-slice.jsonl", read(policy.dev)[:12])
    uri = f"sqlite:///{root}/mlflow.db"
    cwd, path = os.getcwd(), os.environ["PATH"]  # the sweep puts this environment's CLI first on PATH
    os.chdir(root)  # the store's artifact root (./mlruns) lands here, not in the repository
    try:
        with tracking_store(uri):
            cfg = configs.load(SweepConfig, None, dict(zip(
                ["grid", "seeds", "model", "data", "db_root", "eval_data", "eval_names", "output_dir",
                 "overrides"], _args(policy, root)[2::2])))
            report = stage.main(cfg)
            parent = mlflow.search_runs(experiment_names=["slmsql"], filter_string="tags.`slmsql.stage` = 'sweep'",
                                        output_format="list")[0]
    finally:
        os.chdir(cwd)
        os.environ["PATH"] = path
    return {"root": root, "uri": uri, "report": report, "parent": parent}


def _runs(uri):
    import mlflow

    client = mlflow.MlflowClient(uri)
    return client, client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])


@pytest.mark.slow
def test_small_sweep_table_has_one_row_per_variant(small_sweep):
    import mlflow

    parent, uri = small_sweep["parent"], small_sweep["uri"]
    with tracking_store(uri):
        table = mlflow.MlflowClient().load_table(parent.info.experiment_id, "sweep_table.json",
                                                 run_ids=[parent.info.run_id])
    assert list(table["variant"]) == ["runs_tier=0.1", "runs_tier=0.0"]
    assert list(table.columns) == ["variant", "seeds"] + [f"dev-slice/{k}" for k in sweep.ROW_KEYS]
    assert set(table["dev-slice/verdict"]) <= {"improved", "regressed", "no significant difference"}
    assert (table["seeds"] == 2).all()
    rep = small_sweep["report"]
    for row in rep["rows"]:
        assert len(row["ex_seeds"]) == 2 and row["ex_min"] <= row["ex_mean"] <= row["ex_max"]
        assert row["n"] == 12
    out = small_sweep["root"] / "out" / "report"
    assert json.loads((out / "sweep.json").read_text())["rows"] == json.loads(json.dumps(rep["rows"]))
    assert "| runs_tier=0.1 |" in (out / "sweep.md").read_text()
    client, _ = _runs(uri)
    assert {"forest.png", "sweep_table.json", "report"} <= {f.path for f in client.list_artifacts(parent.info.run_id)}


@pytest.mark.slow
def test_small_sweep_cells_are_tagged_children_with_the_same_metric_names(small_sweep):
    parent, uri = small_sweep["parent"], small_sweep["uri"]
    client, runs = _runs(uri)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    by_stage = {}
    for r in children:
        assert r.info.status == "FINISHED"
        by_stage.setdefault(r.data.tags["slmsql.stage"], []).append(r)
    assert {k: len(v) for k, v in by_stage.items()} == {"grpo": 4, "evaluate": 5}  # + the baseline evaluation
    cells = {(r.data.tags["slmsql.variant"], r.data.tags["slmsql.seed"]) for r in by_stage["grpo"]}
    assert cells == {(v, s) for v in ("runs_tier=0.1", "runs_tier=0.0") for s in ("0", "1")}
    assert len({frozenset(r.data.metrics) for r in by_stage["grpo"]}) == 1  # the compare view lines them up
    # however long each cell ran (10 s sampling; a 2-step cell may take less): its system metrics are there
    assert all("system/cpu_utilization_percentage" in r.data.metrics for r in by_stage["grpo"])
    evals = [r for r in by_stage["evaluate"] if r.data.tags["slmsql.variant"] != "baseline"]
    # the same names in every cell, but for the one logged only where finite: the MDD is infinite where this n
    # cannot detect any difference, which depends on each cell's own answers (so: each cell's, recomputed)
    finite_only = {"vs_baseline/mdd"}
    assert len({frozenset(r.data.metrics) - finite_only for r in evals}) == 1
    assert "vs_baseline/p" in evals[0].data.metrics
    for r in evals:
        m = {k.removeprefix("vs_baseline/"): v for k, v in r.data.metrics.items()}
        n = int(m["only_this_right"] + m["only_baseline_right"] + m["both_right"] + m["both_wrong"])
        mdd = stats.min_detectable_difference(n, (m["both_right"] + m["only_baseline_right"]) / n,
                                              (m["only_this_right"] + m["only_baseline_right"]) / n or None,
                                              alpha=float(r.data.params["alpha"]))
        assert ("mdd" in m) == math.isfinite(mdd), (r.data.tags["slmsql.variant"], mdd)
        assert m.get("mdd", math.inf) == pytest.approx(mdd, rel=1e-3)
    [base] = [r for r in by_stage["evaluate"] if r.data.tags["slmsql.variant"] == "baseline"]
    assert {r.data.tags["slmsql.baseline_run"] for r in evals} == {base.info.run_id}
    assert {r.data.params["runs_tier"] for r in by_stage["grpo"]} == {"0.1", "0.0"}
    assert {r.data.params["seed"] for r in by_stage["grpo"]} == {"0", "1"}


@pytest.mark.slow
def test_rerun_reuses_every_cell(small_sweep, policy, caplog, monkeypatch):
    """Through the CLI's options, as a user reruns it: every step is found finished, nothing trains again."""
    import logging

    root, uri = small_sweep["root"], small_sweep["uri"]
    _, before = _runs(uri)
    monkeypatch.chdir(root)
    monkeypatch.setenv("PATH", os.environ["PATH"])  # restored after the sweep changes it
    caplog.set_level(logging.INFO, logger="slmsql.workflow.steps")
    with tracking_store(uri):
        again = CliRunner().invoke(cli, _args(policy, root))  # in this process: no second start-up to pay
    assert again.exit_code == 0, again.output
    steps = [r.getMessage() for r in caplog.records if r.name == "slmsql.workflow.steps"]
    assert len(steps) == 9 and all("reused run" in m for m in steps)  # 4 grpo + 4 evaluate + the baseline
    client, after = _runs(uri)
    new = [r for r in after if r.info.run_id not in {b.info.run_id for b in before}]
    assert [r.data.tags["slmsql.stage"] for r in new] == ["sweep"]  # only the new parent
    assert new[0].data.metrics["cells_reused"] == new[0].data.metrics["cells"] == 4
    assert "| runs_tier=0.0 |" in again.output  # the table, printed
