"""A study's report from its records alone (slmsql.studies.report) and the README's table generated from the reports
(slmsql.studies.readme, scripts/results_table.py): every number checked against one worked out by hand here."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import t as student_t
from scipy.stats import ttest_1samp

from slmsql.configs import Variant
from slmsql.errors import DataError
from slmsql.stages import sweep
from slmsql.studies import diagnosis, readme, report

ROOT = Path(__file__).parents[1]
T_975 = {2: 4.303, 9: 2.262}  # Student's t, 97.5% quantile, from the printed table (df 2, 9)


def ids(n: int) -> list[str]:
    return [f"q-{i:03d}" for i in range(n)]


def record(cell: str, arm, seed, results: dict, code="abc123456789", threads="2") -> dict:
    """A record as the runner writes one; `results`: {eval set: [correct per question, q-000 on]}."""
    return {"schema": "slmsql.study-record/1", "study": "toy", "cell": cell, "arm": arm, "seed": seed, "config": {},
            "start": {"fingerprint": "f00d"}, "code_version": code,
            "float_path": {"torch": "2.13.0", "cpu_capability": "AVX512", "threads": threads, "device": "cpu"},
            "results": {es: {q: [bool(c), f"{i:04x}"] for i, (q, c) in enumerate(zip(ids(len(v)), v))}
                        for es, v in results.items()},
            "metrics": {}, "mlflow": {"grpo_run": f"run-{cell}"}, "finished_at": "2026-12-03T09:00:00Z"}


def start_record(results: dict) -> dict:
    return record("start", None, None, results)


def cell(arm: str, seed: int, results: dict, **kw) -> dict:
    return record(f"{arm}-seed{seed}", arm, seed, results, **kw)


def study(arms, seeds, eval_sets=("dev",), comparisons=None, plan=None) -> dict:
    return {"name": "toy", "question": "Does GRPO raise EX?", "title": "a toy study", "alpha": 0.05, "arms": arms,
            "seeds": seeds, "eval_sets": list(eval_sets),
            "comparisons": comparisons or [{"arm": a, "against": "start", "eval_set": e} for a in arms
                                           for e in eval_sets],
            "cells": [{"cell": f"{a}-seed{s}", "arm": a, "seed": s} for a in arms for s in seeds],
            "plan": plan or {"family": 1}}


def right(n: int, *which) -> list[bool]:
    """n questions, right on those numbered."""
    return [i in which for i in range(n)]


# ---- the numbers -----------------------------------------------------------------------------------------------

def test_arm_vs_start_is_the_paired_t_worked_by_hand():
    """10 questions; the start right on 3, every seed right on those and 3 more: each question's difference is
    1 (3 of them) or 0 (7), mean 0.3, sd^2 = (3 * 0.7^2 + 7 * 0.3^2) / 9 = 2.1 / 9, so
    t = 0.3 / sqrt(2.1 / 9 / 10) = 1.964 on 9 df and the interval 0.3 +- 2.262 se: [-0.046, +0.646]."""
    start = start_record({"dev": right(10, 0, 1, 2)})
    cells = [cell("grpo", s, {"dev": right(10, 0, 1, 2, 3, 4, 5)}) for s in (0, 1, 2)]
    rep = report.build(study(["grpo"], [0, 1, 2]), start, cells)
    [row] = rep["rows"]
    se = math.sqrt(2.1 / 9 / 10)
    assert row["diff"] == pytest.approx(0.3) and row["t"] == pytest.approx(0.3 / se) and row["df"] == 9
    assert round(row["t"], 3) == 1.964
    assert (row["diff_ci_low"], row["diff_ci_high"]) == pytest.approx((0.3 - T_975[9] * se, 0.3 + T_975[9] * se),
                                                                      abs=1e-3)
    assert row["p"] == pytest.approx(2 * student_t.sf(0.3 / se, 9))  # 0.081
    assert (row["ex_b"], row["ex_mean"], row["ex_sd"], row["diff_seeds"]) == (0.3, 0.6, 0.0, [pytest.approx(0.3)] * 3)
    assert row["p_holm"] == row["p"] and row["verdict"] == "no significant difference"  # a family of one
    # identical seeds: no spread between them, so the method's se is the pooled one, but on seeds - 1 = 2 df
    assert (row["seed_df"], row["var_seed"], row["seed_diff_sd"]) == (2, 0, 0)
    assert row["seed_p"] == pytest.approx(2 * student_t.sf(0.3 / se, 2))  # 0.188
    assert row["seed_diff_ci_low"] == pytest.approx(0.3 - T_975[2] * se, abs=1e-3)
    assert rep["eval_sets"] == [{"name": "dev", "n": 10, "ex_b": 0.3}] and rep["missing"] == []


def test_arm_vs_start_is_the_sweeps_row():
    """The same records through a sweep's report (stages/sweep.py) give the same row, number for number."""
    rng = np.random.default_rng(3)
    base = rng.random(40) < 0.4
    runs = [np.where(rng.random(40) < 0.3, True, base) for _ in range(3)]
    rep = report.build(study(["grpo"], [0, 1, 2]), start_record({"dev": base}),
                       [cell("grpo", s, {"dev": r}) for s, r in enumerate(runs)])
    plan = sweep.Plan([Variant("grpo", {})], {}, None, [sweep.EvalSet("dev", "", "")], [0, 1, 2])
    correct = {"b": dict(zip(ids(40), map(bool, base))),
               **{f"e{s}": dict(zip(ids(40), map(bool, r))) for s, r in enumerate(runs)}}
    cells = [{"variant": "grpo", "seed": s, "grpo_run": "g", "eval_runs": {"dev": f"e{s}"},
              "baseline_runs": {"dev": "b"}, "reused": False} for s in range(3)]
    [want] = sweep.report(plan, cells, correct, 0.05)["rows"]
    [row] = rep["rows"]
    assert want["seed_p"] is not None
    for key in (*sweep.ROW_KEYS, "n", "seeds", "ex_seeds", "ex_b", "t", "df", "seed_df", "var_seed", "var_question",
                "var_within"):
        assert row[key] == want[key], key


def arms_2x3():
    """Two arms, 2 seeds x 3 questions; per seed and question a - b is [1, 1, 1] (seed 0) and [0, 1, -1] (seed 1)."""
    a = {0: [1, 1, 1], 1: [1, 1, 0]}
    b = {0: [0, 0, 0], 1: [1, 0, 1]}
    cells = [cell(name, s, {"dev": x[s]}) for name, x in (("a", a), ("b", b)) for s in (0, 1)]
    return start_record({"dev": [0, 0, 0]}), cells


def test_arm_vs_arm_worked_by_hand():
    """Pooled: per question, mean over seeds of a minus of b = [0.5, 1, 0]: mean 0.5, sd 0.5, se 0.5 / sqrt(3),
    t = sqrt(3) on 2 df, interval 0.5 +- 4.303 se. Over seeds, the 2 x 3 array's ANOVA by hand: grand mean 0.5,
    seed means 1 and 0 -> MS_seed = 3 (0.25 + 0.25) / 1 = 1.5; question means 0.5, 1, 0 -> MS_question =
    2 (0 + 0.25 + 0.25) / 2 = 0.5; residuals 0, -0.5, 0.5 / 0, 0.5, -0.5 -> MS_within = 1 / 2 = 0.5. So
    var_seed = (1.5 - 0.5) / 3 = 1/3, and the method's Var(mean) = (MS_seed + max(0, MS_question - MS_within)) / 6
    = 0.25: se 0.5, t = 1 on 2 - 1 = 1 df, p = 0.5: the t-test on the per-seed differences +1 and 0 (mean 0.5, sd
    0.707, se 0.5; t table, 1 df: 12.706)."""
    start, cells = arms_2x3()
    rep = report.build(study(["a", "b"], [0, 1], comparisons=[{"arm": "a", "against": "b", "eval_set": "dev"}]),
                       start, cells)
    [row] = rep["rows"]
    se = 0.5 / math.sqrt(3)
    assert row["label"] == "a vs b" and row["complete"] and row["n"] == 3
    assert (row["diff"], row["t"], row["df"]) == pytest.approx((0.5, math.sqrt(3), 2))
    assert (row["diff_ci_low"], row["diff_ci_high"]) == pytest.approx((0.5 - T_975[2] * se, 0.5 + T_975[2] * se),
                                                                      abs=1e-3)
    assert row["p"] == pytest.approx(2 * student_t.sf(math.sqrt(3), 2))  # 0.225
    assert (row["var_seed"], row["var_question"], row["var_within"]) == pytest.approx((1 / 3, 0, 0.5))
    assert row["seed_df"] == 1 and row["seed_p"] == pytest.approx(0.5)  # t = 1 on 1 df: the Cauchy's quartile
    assert row["seed_p"] == pytest.approx(ttest_1samp([1.0, 0.0], 0.0).pvalue)
    assert row["seed_diff_sd"] == pytest.approx(math.sqrt(0.5))
    half = 12.706 * 0.5
    assert (row["seed_diff_ci_low"], row["seed_diff_ci_high"]) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-3)
    # EX: a's seeds 3/3 and 2/3, b's 0/3 and 2/3; per seed a - b: +1 and 0
    assert row["ex_seeds"] == pytest.approx([1, 2 / 3]) and row["ex_b"] == pytest.approx(1 / 3)
    assert row["diff_seeds"] == pytest.approx([1, 0])
    assert row["verdict"] == row["seed_verdict"] == "no significant difference"


def test_arm_vs_arm_without_spread_between_seeds_has_the_pooled_se_on_seeds_minus_1_df():
    """b differs between its seeds, and a is b with questions 0 and 1 turned right in each seed: every seed's
    difference is [1, 1, 0, 0, 0, 0], so no between-seed variance: mean 1/3, sd^2 = (2 (2/3)^2 + 4 (1/3)^2) / 5 =
    4/15, t = (1/3) / sqrt(4/15 / 6) = sqrt(2.5), the pooled test's t; over seeds the same t on 2 - 1 = 1 df (the
    seed term is kept: 2 seeds that agree are not evidence that seeds agree)."""
    b = {0: [0, 0, 1, 1, 0, 1], 1: [0, 0, 0, 1, 1, 0]}
    a = {s: [1, 1, *x[2:]] for s, x in b.items()}
    cells = [cell(name, s, {"dev": x[s]}) for name, x in (("a", a), ("b", b)) for s in (0, 1)]
    rep = report.build(study(["a", "b"], [0, 1], comparisons=[{"arm": "a", "against": "b", "eval_set": "dev"}]),
                       start_record({"dev": [0] * 6}), cells)
    [row] = rep["rows"]
    assert row["t"] == pytest.approx(math.sqrt(2.5)) and row["var_seed"] == 0 and row["df"] == 5
    assert row["seed_df"] == 1 and row["seed_p"] == pytest.approx(2 * student_t.sf(math.sqrt(2.5), 1))
    assert row["seed_p"] > row["p"]


# ---- Holm over the declared family, and records missing --------------------------------------------------------

def test_holm_takes_the_declared_family_a_missing_row_as_p_1():
    """Family of 3, each arm vs the start on 10 questions the start gets all wrong. `up` gets all right in both
    seeds (every difference 1: p = 0); `flat` gets 3 right (the hand case above: p = 0.0811); `part` has one of its
    2 seeds recorded: it enters as p = 1. Holm, ascending: 0 x 3 = 0, 0.0811 x 2 = 0.162, 1 x 1 = 1."""
    start = start_record({"dev": right(10)})
    cells = [cell("up", s, {"dev": [1] * 10}) for s in (0, 1)] + \
        [cell("flat", s, {"dev": right(10, 0, 1, 2)}) for s in (0, 1)] + [cell("part", 0, {"dev": right(10, 0)})]
    rep = report.build(study(["up", "flat", "part"], [0, 1]), start, cells)
    up, flat, part = rep["rows"]
    p_flat = 2 * student_t.sf(0.3 / math.sqrt(2.1 / 9 / 10), 9)
    assert round(p_flat, 4) == 0.0811 and flat["p"] == pytest.approx(p_flat)
    assert (up["p"], up["p_holm"], up["verdict"]) == (0, 0, "improved")
    assert flat["p_holm"] == pytest.approx(2 * p_flat) and flat["verdict"] == "no significant difference"
    # the method's family too: flat's seeds agree, so its t over seeds is the pooled one on 1 df
    assert (up["seed_p_holm"], flat["seed_p_holm"]) == pytest.approx(
        (0, 2 * 2 * student_t.sf(0.3 / math.sqrt(2.1 / 9 / 10), 1)))
    # the incomplete row: its estimate from the seed present, no Holm p, no verdict, and why
    assert part["diff"] == pytest.approx(0.1) and part["seeds"] == 1 and part["seed_ids"] == [0]
    assert part["p_holm"] is part["verdict"] is part["seed_verdict"] is None and not part["complete"]
    assert part["missing"] == ["part-seed1"] and part["reason"] == "records missing: part-seed1"
    assert rep["missing"] == ["part-seed1"] and rep["records"] == {"cells": 5, "declared": 6, "start": True}
    assert rep["comparisons"] == 3 and "3 declared comparisons" in rep["adjustment"]
    md = report.markdown(rep)
    assert "| part vs start |" in md and "no verdict: records missing: part-seed1" in md
    assert "- `part-seed1` (records/part-seed1.json)" in md


def test_without_a_start_record_every_row_waits():
    start, cells = arms_2x3()
    rep = report.build(study(["a", "b"], [0, 1], comparisons=[{"arm": "a", "against": "b", "eval_set": "dev"},
                                                              {"arm": "a", "against": "start", "eval_set": "dev"}]),
                       None, cells)
    vs_b, vs_start = rep["rows"]
    assert rep["missing"] == ["start"] and rep["start"] is None and rep["eval_sets"][0]["ex_b"] is None
    assert vs_b["diff"] == pytest.approx(0.5) and vs_b["verdict"] is None and vs_b["missing"] == ["start"]
    assert vs_start["diff"] is None and vs_start["verdict"] is None and vs_start["n"] == 3
    assert "the start's record missing" in report.markdown(rep)


def test_a_planned_study_with_no_records_gets_a_report(tmp_path):
    s = study(["outcome", "dense"], [0, 1, 2], eval_sets=("dev", "cross"))
    rep = report.build(s, None, [])
    assert rep["missing"] == ["start", *(c["cell"] for c in s["cells"])]
    assert len(rep["rows"]) == 4 and all(r["verdict"] is None and r["diff"] is None for r in rep["rows"])
    assert rep["eval_sets"] == [{"name": "dev", "n": None, "ex_b": None}, {"name": "cross", "n": None, "ex_b": None}]
    report.write(tmp_path, rep)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forest.png", "report.json", "report.md"]
    assert "No records yet." in (tmp_path / "report.md").read_text()


def test_a_cell_that_scored_other_questions_is_refused_by_name():
    start = start_record({"dev": right(4, 0)})
    odd = cell("grpo", 1, {"dev": right(4, 0, 1)})
    odd["results"]["dev"]["q-009"] = odd["results"]["dev"].pop("q-003")
    with pytest.raises(DataError, match=r"records/grpo-seed1\.json: field 'results\.dev': scored other questions "
                                        r"than the start on 'dev': 1 not there \['q-009'\], 1 of its missing"):
        report.build(study(["grpo"], [0, 1]), start, [cell("grpo", 0, {"dev": right(4)}), odd])
    with pytest.raises(DataError, match=r"records/grpo-seed0\.json: field 'results\.cross': no results"):
        report.build(study(["grpo"], [0, 1], eval_sets=("dev", "cross")),
                     start_record({"dev": right(4), "cross": right(4)}), [cell("grpo", 0, {"dev": right(4)})])
    with pytest.raises(DataError, match=r"records/grpo-seed7\.json: field 'cell': 'grpo-seed7' is not a declared"):
        report.build(study(["grpo"], [0, 1]), start, [cell("grpo", 7, {"dev": right(4)})])


def diag(**figures) -> dict:
    """A record's diagnosis (studies/diagnosis.py): 20 logged steps, the figures given, the rest not in its log."""
    return {**dict.fromkeys(diagnosis.KEYS), "logged_steps": 20, **figures}


def diagnosed(arm: str, seed: int, results: dict, **figures) -> dict:
    return {**cell(arm, seed, results), "diagnosis": diag(**figures)}


def test_the_diagnosis_per_arm_is_the_mean_over_its_seeds_and_the_turned_counts_against_the_start():
    """8 questions, the start right on q0-q3. Arm a: both seeds diagnosed; seed 0 right on q2-q5 (turned right q4,
    q5; wrong q0, q1), seed 1 on q0-q6 (right q4-q6): 2.5 / 1.0. Arm b: seed 1's record from before the diagnosis
    (its figures are seed 0's alone; its answers still count: seed 1 turned q3 wrong). Arm c: no diagnosis at all;
    all wrong then all right: 2.0 / 2.0. Arm d: no record."""
    start = start_record({"dev": right(8, 0, 1, 2, 3)})
    cells = [diagnosed("a", 0, {"dev": right(8, 2, 3, 4, 5)}, pass_first10=0.1, pass_last10=0.5, groups_vary=0.5,
                       zero_std=0.2, cut_first10=0.5, cut_last10=0.0, draws_min=2, draws_max=3, reward_std=0.4,
                       grad_norm=0.5, length=80.0),
             diagnosed("a", 1, {"dev": right(8, *range(7))}, pass_first10=0.3, pass_last10=0.7, groups_vary=0.7,
                       zero_std=0.4, draws_min=3, draws_max=4, reward_std=0.2, grad_norm=1.5,
                       length=61.0),  # a log without clipped_ratio
             diagnosed("b", 0, {"dev": right(8, 0, 1, 2, 3)}, pass_first10=0.4, pass_last10=0.4),
             cell("b", 1, {"dev": right(8, 0, 1, 2)}),
             cell("c", 0, {"dev": right(8)}), cell("c", 1, {"dev": right(8, *range(8))})]
    rep = report.build(study(["a", "b", "c", "d"], [0, 1]), start, cells)
    a, b, c, d = rep["diagnosis"]
    assert a == {"arm": "a", "seeds": [0, 1], "diagnosed": [0, 1], "logged_steps": 20, "pass_first10": 0.2,
                 "pass_last10": 0.6, "groups_vary": 0.6, "zero_std": pytest.approx(0.3), "cut_first10": 0.5,
                 "cut_last10": 0.0, "reward_std": pytest.approx(0.3), "grad_norm": 1.0, "length": 70.5, "draws_min": 2,
                 "draws_max": 4, "turned": {"dev": {"right": 2.5, "wrong": 1.0}},
                 "cells": [{"seed": 0, "diagnosis": cells[0]["diagnosis"], "turned": {"dev": {"right": 2, "wrong": 2}}},
                           {"seed": 1, "diagnosis": cells[1]["diagnosis"], "turned": {"dev": {"right": 3, "wrong": 0}}}]}
    assert (b["diagnosed"], b["pass_first10"], b["groups_vary"], b["turned"]) == ([0], 0.4, None,
                                                                                   {"dev": {"right": 0, "wrong": 0.5}})
    assert (c["diagnosed"], c["pass_first10"], c["draws_min"], c["turned"]) == ([], None, None,
                                                                                 {"dev": {"right": 2, "wrong": 2}})
    assert (d["seeds"], d["turned"]) == ([], {"dev": None})
    md = report.markdown(rep)
    assert ("| arm | seeds | train pass rate, first -> last 10 steps | groups varying | zero reward std | cut at the "
            "token budget, first -> last 10 | reward std | grad norm | length | draws per band question | dev: turned "
            "right / wrong |\n") in md
    assert "| a | 0, 1 | 0.20 -> 0.60 | 60% | 30% | 50% -> 0% | 0.30 | 1.00 | 70 | 2-4 | 2.5 / 1.0 |\n" in md
    assert ("| b | 0, 1 (diagnosis not recorded: 1) | 0.40 -> 0.40 | n/a | n/a | n/a | n/a | n/a | n/a | n/a | "
            "0.0 / 0.5 |\n") in md
    assert "| c | 0, 1 |" + " not recorded |" * 8 + " 2.0 / 2.0 |\n" in md
    assert "| d | none recorded |" + " n/a |" * 9 + "\n" in md
    # each seed under its arm's mean, its own figures: a seed that went its own way is not hidden in the mean
    assert ("| a | 0, 1 | 0.20 -> 0.60 | 60% | 30% | 50% -> 0% | 0.30 | 1.00 | 70 | 2-4 | 2.5 / 1.0 |\n"
            "| a | seed 0 | 0.10 -> 0.50 | 50% | 20% | 50% -> 0% | 0.40 | 0.50 | 80 | 2-3 | 2 / 2 |\n"
            "| a | seed 1 | 0.30 -> 0.70 | 70% | 40% | n/a | 0.20 | 1.50 | 61 | 3-4 | 3 / 0 |\n") in md
    assert ("| b | seed 0 | 0.40 -> 0.40 | n/a | n/a | n/a | n/a | n/a | n/a | n/a | 0 / 0 |\n"
            "| b | seed 1 |" + " not recorded |" * 8 + " 0 / 1 |\n") in md
    assert "| d | seed" not in md
    # a record from before the seed's telemetry: its columns n/a, the rest as they were
    old = {k: v for k, v in cells[0]["diagnosis"].items() if k not in diagnosis.TELEMETRY}
    assert "| a | 0 | 0.10 -> 0.50 | 50% | 20% | 50% -> 0% | n/a | n/a | n/a | 2-3 | 2.0 / 2.0 |\n" in report.markdown(
        report.build(study(["a"], [0]), start, [{**cells[0], "diagnosis": old}]))
    # without the start's record nothing is turned against it
    assert "| a | 0, 1 | 0.20 -> 0.60 | 60% | 30% | 50% -> 0% | 0.30 | 1.00 | 70 | 2-4 | n/a |\n" in report.markdown(
        report.build(study(["a", "b", "c", "d"], [0, 1]), None, cells))


# ---- the files -------------------------------------------------------------------------------------------------

def _mixed():
    """A complete arm and one with a record missing, their cells from two float paths, two eval sets; the complete
    arm's records carry a diagnosis, the other's are older ones, without."""
    res = lambda k: {"dev": right(12, *range(k)), "cross": right(12, *range(k - 1))}  # noqa: E731
    cells = [{**cell("outcome", s, res(6 + s), threads=str(1 + s % 2)),
              "diagnosis": diag(pass_first10=0.1 * s, pass_last10=0.3, zero_std=1 / 3)} for s in (0, 1, 2)] + \
        [cell("dense", s, res(7 + s)) for s in (0, 1)]
    s = study(["outcome", "dense"], [0, 1, 2], eval_sets=("dev", "cross"),
              comparisons=[{"arm": "outcome", "against": "start", "eval_set": "dev"},
                           {"arm": "outcome", "against": "start", "eval_set": "cross"},
                           {"arm": "dense", "against": "outcome", "eval_set": "dev"}],
              plan={"family": 3, "mdd_90pct_3_seeds": "13.2 points", "readme": [0, 2]})
    return s, start_record(res(4)), cells


def test_report_files_are_the_same_bytes_each_time(tmp_path):
    s, start, cells = _mixed()
    for folder in ("one", "two"):
        (tmp_path / folder).mkdir()
        report.write(tmp_path / folder, report.build(s, start, list(reversed(cells))))  # record order: no matter
    for name in report.FILES:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    rep = json.loads((tmp_path / "one" / "report.json").read_text(),
                     parse_constant=lambda c: pytest.fail(f"{c} in report.json"))
    assert [r["label"] for r in rep["rows"]] == ["outcome vs start", "outcome vs start", "dense vs outcome"]
    # dense-seed2 missing: dense vs outcome on the seeds both have, paired, pooled and over seeds alike
    dense = rep["rows"][2]
    assert dense["seed_ids"] == [0, 1] and dense["diff_seeds"] == pytest.approx([1 / 12, 1 / 12])
    assert dense["diff"] == pytest.approx(1 / 12) and dense["verdict"] is None
    md = (tmp_path / "one" / "report.md").read_text()
    assert md.startswith("# a toy study\n\n**Question.** Does GRPO raise EX?")
    assert "- **mdd_90pct_3_seeds**: 13.2 points" in md and "**cross**: n = " in md
    assert "| comparison | EX compared with | EX mean |" in md  # dev holds an arm-vs-arm row: each row's own base
    # provenance: which float path made which cell
    assert "2 float path(s), 1 code version(s)." in md
    assert "| cell | code version | torch | cpu_capability | threads | device |\n" in md
    assert "| outcome-seed1 | abc123456789 | 2.13.0 | AVX512 | 2 | cpu |\n" in md
    assert "| outcome-seed0 | abc123456789 | 2.13.0 | AVX512 | 1 | cpu |\n" in md
    assert ("| outcome | 0, 1, 2 | 0.10 -> 0.30 | n/a | 33% | n/a | n/a | n/a | n/a | n/a | 3.0 / 0.0 | 3.0 / 0.0 "
            "|\n") in md
    assert "| dense | 0, 1 |" + " not recorded |" * 8 + " 3.5 / 0.0 | 3.5 / 0.0 |\n" in md
    assert "2026-12-03" not in md  # no clock in the document: the same results read the same
    assert rep["provenance"][1]["finished_at"] == "2026-12-03T09:00:00Z"  # the numbers file keeps it
    assert (tmp_path / "one" / "forest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_leaves_the_old_files_when_the_forest_fails(tmp_path, monkeypatch):
    s, start, cells = _mixed()
    report.write(tmp_path, report.build(s, start, cells[:3]))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def broken(rep):
        raise RuntimeError("no figure today")

    monkeypatch.setattr(report, "forest", broken)
    with pytest.raises(RuntimeError, match="no figure today"):
        report.write(tmp_path, report.build(s, start, cells))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no new report.json, no .tmp
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RuntimeError):
        report.write(empty, report.build(s, start, cells))
    assert list(empty.iterdir()) == []


# ---- the README's table ----------------------------------------------------------------------------------------

TABLE = """# x

<!-- generated: studies/*/report.json (scripts/results_table.py) -->

| experiment | eval set (n) | before → after GRPO | difference [95% CI] | p | verdict |
|---|---|---|---|---|---|
| seed: typed | BIRD (149) | 36.9% → 36.2% | ±16 | 1.0 | no significant difference |
| `studies/gone`: an old generated row | dev (1) | — | — | — | — |

<!-- end generated -->

after
"""


def test_the_readme_and_docs_tables_are_what_the_script_writes():
    """Today's studies/*/report.json (none yet: no generated rows) in README.md and docs/index.md, as the script
    writes them; after a report changes, run `python scripts/results_table.py`."""
    assert readme.update(ROOT, check=True) == []


def test_the_generator_writes_each_studys_rows_and_keeps_the_typed_ones(tmp_path):
    """Three synthetic studies: the hand case of 10 questions (+30.0 [-4.6, +64.6], p 0.081, a family of one), one
    with a record missing and one with none: these two have no numbers, so no row, each a line under the table.
    p as the README writes it (stats.wording: 2 decimals); the header says which is adjusted."""
    hand = report.build(study(["grpo"], [0, 1, 2]), start_record({"dev": right(10, 0, 1, 2)}),
                        [cell("grpo", s, {"dev": right(10, *range(6))}) for s in (0, 1, 2)])
    s, start, cells = _mixed()
    planned = report.build({**study(["a"], [0]), "title": "a planned study"}, None, [])
    for name, rep in (("hand", hand), ("mixed", report.build(s, start, cells)), ("planned", planned)):
        (tmp_path / "studies" / name).mkdir(parents=True)
        (tmp_path / "studies" / name / "report.json").write_text(json.dumps(rep))
    (tmp_path / "docs").mkdir()
    for f in readme.FILES:
        (tmp_path / f).write_text(TABLE)
    script = [sys.executable, str(ROOT / "scripts" / "results_table.py"), "--root", str(tmp_path)]
    check = subprocess.run([*script, "--check"], capture_output=True, text=True)
    assert check.returncode == 1 and "README.md: differs" in check.stdout and "docs/index.md: differs" in check.stdout
    assert subprocess.run(script, capture_output=True, text=True).returncode == 0
    text = (tmp_path / "README.md").read_text()
    assert (tmp_path / "docs" / "index.md").read_text() == text
    head, rest = text.split("|---|---|---|---|---|---|\n")
    assert head.endswith("| difference [unadjusted 95% CI] | p (Holm-adjusted, or family of 1) | verdict |\n")
    table, *under = rest.split("\n\n")
    assert table.splitlines() == [
        "| seed: typed | BIRD (149) | 36.9% → 36.2% | ±16 | 1.0 | no significant difference |",  # kept
        "| `studies/hand`: a toy study (grpo vs start) | dev (10) | 30.0% → 60.0% | +30.0 [−4.6, +64.6] | "
        "0.08 (family of 1) | no significant difference |"]
    # no row without numbers: the studies that wait for records are named under the table
    assert under[:2] == ["Declared, not yet run (no records): `studies/planned` (a planned study).",
                         "Records not all in (no numbers until they are): `studies/mixed` (5 of 6 cells)."]
    assert "| `studies/mixed`" not in text and "| `studies/planned`" not in text
    assert text.startswith("# x\n\n<!-- generated:") and text.endswith("<!-- end generated -->\n\nafter\n")
    assert subprocess.run([*script, "--check"], capture_output=True, text=True).returncode == 0  # now in step
    assert readme.rewrite(text, *readme.generated(tmp_path)[:1], notes=readme.generated(tmp_path)[1]) == text


def test_the_generator_refuses_what_it_cannot_place(tmp_path):
    with pytest.raises(DataError, match="README.md: no marked table"):
        readme.rewrite("# x\n| a |\n", [])
    with pytest.raises(DataError, match=r"README.md:7: between the markers only the table"):
        readme.rewrite(TABLE.replace("|---|---|---|---|---|---|\n", "|---|---|---|---|---|---|\nprose\n"), [])
    bad = {"rows": [{"index": 0, "eval_set": "dev"}], "eval_sets": [{"name": "dev"}], "plan": {"readme": [3]}}
    with pytest.raises(DataError, match=r"report.json: field 'plan.readme': expected a list of comparison indexes"):
        readme.rows("x", {**bad, "records": {}, "missing": []})


def test_secondary_comparisons_stay_outside_the_holm_family_with_their_p_unadjusted():
    """Two arms against the start on dev (the family of 2), and the same on a second set declared secondary. 10
    questions, the start right on 3; arm a right on 6 (every seed): each question's difference 1 (3) or 0 (7), the
    paired t of the first test (p 0.081 on 9 df); arm b equal to the start (p 1). In the family Holm doubles a's p
    (the smaller of 2); on the secondary set the same p stays as it is, and the family's is what it is without them."""
    start = start_record({"dev": right(10, 0, 1, 2), "seen": right(10, 0, 1, 2)})
    cells = [cell(a, s, {es: right(10, *(range(6) if a == "a" else range(3))) for es in ("dev", "seen")})
             for a in ("a", "b") for s in (0, 1)]
    family = [{"arm": a, "against": "start", "eval_set": "dev"} for a in ("a", "b")]
    plain = report.build(study(["a", "b"], [0, 1], ("dev", "seen"), family), start, cells)
    rep = report.build({**study(["a", "b"], [0, 1], ("dev", "seen"), family),
                        "secondary": [{"arm": a, "against": "start", "eval_set": "seen"} for a in ("a", "b")]},
                       start, cells)
    p = 2 * student_t.sf(0.3 / math.sqrt(2.1 / 9 / 10), 9)
    assert [r["p_holm"] for r in rep["rows"]] == [pytest.approx(2 * p), 1.0] == [r["p_holm"] for r in plain["rows"]]
    a, b = rep["secondary"]
    assert (a["eval_set"], a["p"], a["p_holm"], b["p_holm"]) == ("seen", pytest.approx(p), pytest.approx(p), 1.0)
    assert rep["adjustment"] == plain["adjustment"] == "Holm over the 2 declared comparisons (one with records " \
                                                      "missing enters as p = 1)"
    md = report.markdown(rep)
    assert "**Secondary comparisons.** Declared outside the Holm family" in md and "**seen** (secondary)" in md
    assert "secondary" not in plain and "Secondary" not in report.markdown(plain)
