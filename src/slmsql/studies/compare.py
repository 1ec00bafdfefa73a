"""A comparison row from per-question results, and Holm's verdicts over a family of rows: the statistics a sweep's
table and a study's report share (stages/sweep.py, studies/report.py).

A row against the start pools the seeds per question (`inference.compare_seeds`) and makes the seeds a random unit
too (`seedstats.summary`). A row of one arm against another pairs seed s of one with seed s of
the other: both arms train with the same seeds, and the same seed draws the same prompt order. Pooled, it takes
per question the mean over seeds of one minus the mean over seeds of the other (`inference.paired_t`); over seeds,
their difference per seed and question is one crossed array (`seedstats.differences_summary`).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from slmsql.stats import inference, seedstats

ARM_METHOD = ("paired t-test on per-question differences (mean over seeds of one arm minus mean over seeds of the "
              "other), with the matching t interval")
STAT_KEYS = ("n", "seeds", "ex_seeds", "ex_mean", "ex_sd", "ex_min", "ex_max", "ex_b", "diff", "diff_ci_low",
             "diff_ci_high", "t", "df", "p")
SEED_KEYS = ("seed_diff_ci_low", "seed_diff_ci_high", "seed_df", "seed_p", "seed_diff_sd", "var_seed", "var_question",
             "var_within")


def vs_start(runs: Sequence[Sequence[bool]], baseline: Sequence[bool], alpha: float) -> dict:
    """Several seeds of one policy against the start, questions aligned: a sweep row's numbers."""
    res = inference.compare_seeds(runs, baseline, alpha)
    return {**{k: res[k] for k in STAT_KEYS}, **seedstats.summary(runs, baseline, alpha)}


def vs_arm(a: dict[int, Sequence[bool]], b: dict[int, Sequence[bool]], alpha: float) -> dict:
    """Arm `a` against arm `b`, each {seed: per-question results}, questions aligned, on the seeds both have
    (seed s paired with seed s: a seed one arm lacks leaves its pair out of both tests, which then speak of the
    same seeds). None without a pair."""
    both = [s for s in a if s in b]
    if not both:
        return None
    ra, rb = (np.asarray([x[s] for s in both], dtype=bool) for x in (a, b))
    if ra.shape != rb.shape:
        raise inference.StatsError(f"the arms scored different questions: {ra.shape[1]} and {rb.shape[1]}")
    ex_a, ex_b = ra.mean(axis=1), rb.mean(axis=1)
    d = ra.mean(axis=0) - rb.mean(axis=0)
    test = inference.paired_t(d, alpha)
    seed = seedstats.differences_summary(ra.astype(float) - rb, alpha)
    return {"n": int(d.size), "seeds": len(both), "ex_seeds": [float(x) for x in ex_a],
            "ex_mean": float(ex_a.mean()), "ex_sd": float(ex_a.std(ddof=1)) if len(both) > 1 else math.nan,
            "ex_min": float(ex_a.min()), "ex_max": float(ex_a.max()), "ex_b": float(ex_b.mean()),
            "diff": test["mean"], "diff_ci_low": test["ci_low"], "diff_ci_high": test["ci_high"], "t": test["t"],
            "df": test["df"], "p": test["p"], **seed, "ex_b_seeds": [float(x) for x in ex_b],
            "diff_seeds": [float(x) for x in ex_a - ex_b], "seed_ids": both}


def adjust(rows: list[dict], alpha: float, seed_family: list[dict], complete=lambda row: True) -> None:
    """Holm over `rows` (the pooled tests' family) and over `seed_family` (the same comparisons, seeds random),
    in place: `p_holm`/`verdict` and `seed_p_holm`/`seed_verdict`. A row that is not `complete` (records missing)
    enters its family as p = 1 and gets no verdict (None): the others' adjusted p can only be as large as with
    its real p, so no verdict gets easier as records go missing. So does a member of `seed_family` without seed_p."""
    for row, p_holm in zip(rows, inference.holm([r["p"] if complete(r) else 1.0 for r in rows])):
        ok = complete(row)
        row["p_holm"] = p_holm if ok else None
        row["verdict"] = inference.verdict(p_holm, row["diff"], alpha) if ok else None
    ps = [r["seed_p"] if complete(r) and r["seed_p"] is not None else 1.0 for r in seed_family]
    for row, p_holm in zip(seed_family, inference.holm(ps)):
        ok = complete(row) and row["seed_p"] is not None
        row["seed_p_holm"] = p_holm if ok else None
        row["seed_verdict"] = inference.verdict(p_holm, row["diff"], alpha) if ok else None
    for row in rows:
        row.setdefault("seed_p_holm", None)
        row.setdefault("seed_verdict", None)


def finite(row: dict, keys=("ex_sd", "t", "seed_df")) -> dict:
    """JSON has no NaN or inf: the sd of one seed, t when every question moved alike, df with no variance."""
    for key in keys:
        row[key] = row[key] if row[key] is not None and math.isfinite(row[key]) else None
    return row
