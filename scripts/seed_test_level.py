"""Which over-seeds test holds its level with 2-5 seeds: simulated studies with no true effect, and with one.

    python scripts/seed_test_level.py                  # 20,000 studies per cell (about a minute on 1 core)
    python scripts/seed_test_level.py --reps 2000      # a quick look

Each simulated study: n questions with logit ability a_i ~ N(0, 1.5); the start is right on question i with
probability expit(a_i), trained seed s with expit(a_i + gain + u_s), u_s ~ N(0, seed_sd) (logit scale: 0.3 makes
seeds' EX differ by about 5 points, sd). At gain 0 the method's true effect is exactly 0 (a and u are symmetric
about 0, so both arms average 1/2). The tests compared, on the seeds x questions array d_si = trained - start:

- `truncated`: the test up to issue 58: the pooled variance plus var_seed / S, var_seed = max(0, (MS_seed -
  MS_within) / n), Satterthwaite df; where var_seed is cut to 0, the pooled t-test (df n - 1).
- `per_seed`: a one-sample t-test on the S per-seed mean differences (df S - 1): seeds the only random unit.
- `min_f`: Clark's (1973) min F' as a t: t^2 = S n mean^2 / (MS_seed + MS_question), Satterthwaite df of that
  sum. Both random terms always in (neither is ever dropped); its df are estimated as the old test's were.
- `seed_t` (slmsql's since issue 58): the per-seed t-test with the questions' variance added, t^2 = S n mean^2 /
  (MS_seed + max(0, MS_question - MS_within)), df S - 1.

It prints, per seeds x seed_sd cell, each test's rejection rate at alpha (null) and its power at a gain of
`--gain` (logit), then one JSON line of all of them. Vectorised over studies; the chosen test
(`seedstats.over_differences`) is checked to equal `seed_t` on the first studies of each cell.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
from scipy.special import expit
from scipy.stats import t as student_t

TESTS = ("truncated", "min_f", "per_seed", "seed_t")


def simulate(rng, reps: int, seeds: int, n: int, seed_sd: float, gain: float) -> np.ndarray:
    """reps x seeds x n per-question differences (trained - start), each in {-1, 0, 1}."""
    a = rng.normal(0, 1.5, (reps, 1, n))
    u = rng.normal(0, seed_sd, (reps, seeds, 1))
    base = rng.random((reps, 1, n)) < expit(a)
    runs = rng.random((reps, seeds, n)) < expit(a + gain + u)
    return runs.astype(float) - base


def p_values(d: np.ndarray) -> dict:
    """Each test's two-sided p for every study of d (reps x seeds x n)."""
    _, s, n = d.shape
    grand = d.mean(axis=(1, 2))
    by_seed, by_q = d.mean(axis=2), d.mean(axis=1)
    ms_seed = n * ((by_seed - grand[:, None]) ** 2).sum(axis=1) / (s - 1)
    ms_q = s * ((by_q - grand[:, None]) ** 2).sum(axis=1) / (n - 1)
    ms_w = ((d - by_seed[:, :, None] - by_q[:, None, :] + grand[:, None, None]) ** 2).sum(axis=(1, 2)) / (
        (s - 1) * (n - 1))

    def p(var_sum, df):  # var_sum: S n Var(grand mean) as estimated
        with np.errstate(divide="ignore", invalid="ignore"):
            t = grand / np.sqrt(var_sum / (s * n))
        return np.where(var_sum > 0, 2 * student_t.sf(np.abs(t), df), (grand == 0).astype(float))

    part = ms_seed - ms_w > 1e-12
    combo = np.where(part, ms_q + ms_seed - ms_w, ms_q)
    with np.errstate(divide="ignore", invalid="ignore"):
        df_trunc = np.where(part, combo ** 2 / (ms_q ** 2 / (n - 1) + ms_seed ** 2 / (s - 1)
                                                + ms_w ** 2 / ((s - 1) * (n - 1))), n - 1)
        df_min_f = (ms_seed + ms_q) ** 2 / (ms_seed ** 2 / (s - 1) + ms_q ** 2 / (n - 1))
    return {"truncated": p(combo, df_trunc), "per_seed": p(ms_seed, s - 1),
            "min_f": p(ms_seed + ms_q, np.nan_to_num(df_min_f, nan=n - 1)),
            "seed_t": p(ms_seed + np.maximum(ms_q - ms_w, 0), s - 1)}


def check_library(d: np.ndarray, ps: np.ndarray, k: int = 20) -> None:
    """The library's test (`seedstats.over_differences`) is `seed_t` on the first k studies."""
    from slmsql.stats.seedstats import over_differences

    for i in range(min(k, len(d))):
        got = over_differences(d[i])["p"]
        if not math.isclose(got, float(ps[i]), rel_tol=1e-9, abs_tol=1e-15):
            raise SystemExit(f"seedstats.over_differences gives p {got}, seed_t {ps[i]} (study {i})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20_000, help="studies per cell")
    ap.add_argument("--n", type=int, default=900, help="questions per study")
    ap.add_argument("--seeds", default="2,3,5")
    ap.add_argument("--seed-sds", default="0,0.2,0.3,0.4", help="between-seed sd, logit scale")
    ap.add_argument("--gain", type=float, default=0.25, help="the alternative's gain, logit scale")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--no-check", action="store_true", help="skip the comparison with slmsql's own test")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(58)
    mc = 3 * math.sqrt(args.alpha * (1 - args.alpha) / args.reps)
    print(f"{args.reps} studies per cell, n = {args.n}, alpha {args.alpha} (3 Monte Carlo se: {mc:.4f})")
    print(f"{'seeds':>5} {'seed_sd':>7} | " + " | ".join(f"{t:>9} null / power" for t in TESTS))
    cells = []
    for seeds in map(int, args.seeds.split(",")):
        for sd in map(float, args.seed_sds.split(",")):
            cell = {"seeds": seeds, "seed_sd": sd}
            for label, gain in (("null", 0.0), ("power", args.gain)):
                d, done = None, {}
                for start in range(0, args.reps, 1000):  # in blocks: reps x seeds x n floats at once is large
                    d = simulate(rng, min(1000, args.reps - start), seeds, args.n, sd, gain)
                    for name, p in p_values(d).items():
                        done.setdefault(name, []).append(p < args.alpha)
                    if start == 0 and label == "null" and not args.no_check:
                        check_library(d, p_values(d)["seed_t"])
                for name in TESTS:
                    cell[f"{name}_{label}"] = float(np.concatenate(done[name]).mean())
            cells.append(cell)
            print(f"{seeds:>5} {sd:>7} | " + " | ".join(f"{cell[t + '_null']:>9.4f} / {cell[t + '_power']:.3f}"
                                                      for t in TESTS), flush=True)
    worst = {t: max(c[f"{t}_null"] for c in cells) for t in TESTS}
    print("worst null rejection rate: " + ", ".join(f"{t} {w:.4f}" for t, w in worst.items())
          + f" (alpha + 3 se: {args.alpha + mc:.4f})")
    print(json.dumps({"reps": args.reps, "n": args.n, "alpha": args.alpha, "mc_3se": mc, "worst_null": worst,
                      "cells": cells}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
