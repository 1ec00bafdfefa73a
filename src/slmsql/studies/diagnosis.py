"""Why a GRPO run gained or did not, from the files it left: the `diagnosis` a study's cell record keeps, which its
report averages per arm (studies/report.py) and scripts/diagnose_study.py prints for a sweep's cells.

From its training log (TRL's `trainer_state.json` `log_history` of its last checkpoint, one entry a logged step):
  - `pass_first10`, `pass_last10`: the sampled training pass rate (`exec/correct`), mean of the first vs the last
    10 logged steps;
  - `groups_vary`, `zero_std`: the mean share of groups whose correctness varies, and of groups whose rewards do
    not vary at all (TRL's `frac_reward_zero_std`: no advantage, no gradient);
  - `cut_first10`, `cut_last10`: the share of completions cut at the token budget (TRL's
    `completions/clipped_ratio`), first vs last 10 steps: a reward that favours longer SQL shows here first;
  - `reward_std`, `grad_norm`, `length`: the mean over logged steps of TRL's `reward_std`, `grad_norm` and
    `completions/mean_length` (tokens), the telemetry the seed's card reports beside `frac_reward_zero_std`;
and from its logged prompts (`completions/*.parquet`): `draws_min`, `draws_max`, how many steps drew each question
of its RL data (a run that trains N passes says N-N). A figure its files lack is None.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Mapping
from pathlib import Path
from statistics import fmean

EDGE = 10  # logged steps at each end of the run
TELEMETRY = ("reward_std", "grad_norm", "length")  # added 2026-12-06: records made before lack them
KEYS = ("logged_steps", "pass_first10", "pass_last10", "groups_vary", "zero_std", "cut_first10", "cut_last10",
        *TELEMETRY, "draws_min", "draws_max")


def log_history(grpo: Path) -> list[dict]:
    """The training log of a GRPO run's output folder: its last checkpoint's trainer_state.json ([] if none)."""
    ckpts = sorted(Path(grpo).glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    return json.loads(ckpts[-1].read_text(encoding="utf-8"))["log_history"] if ckpts else []


def mean(values) -> float | None:
    """The mean of the numbers among `values` (None: there are none); fsum's, so ten 0.1s mean 0.1."""
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return fmean(numbers) if numbers else None


def training(log: list[dict]) -> dict:
    """The training-log figures of the module's docstring, over the steps that logged a pass rate."""
    steps = [h for h in log if "exec/correct" in h]  # the final summary entry (train_runtime) logs none

    def over(key: str, part: slice = slice(None)):
        return mean(h.get(key) for h in steps[part])

    first, last = slice(None, EDGE), slice(-EDGE, None)
    return {"logged_steps": len(steps), "pass_first10": over("exec/correct", first),
            "pass_last10": over("exec/correct", last), "groups_vary": over("exec/frac_groups_correctness_varies"),
            "zero_std": over("frac_reward_zero_std"), "cut_first10": over("completions/clipped_ratio", first),
            "cut_last10": over("completions/clipped_ratio", last), "reward_std": over("reward_std"),
            "grad_norm": over("grad_norm"), "length": over("completions/mean_length")}


def draws(grpo: Path, rl: Mapping[str, dict]) -> Counter:
    """How many steps drew each RL question (`rl`: id -> row with its `question`): steps whose logged prompts
    (`completions/*.parquet`, one file a step, a prompt once per completion of its group) hold its question text.
    Questions never drawn are absent."""
    import pandas as pd

    steps = defaultdict(set)  # question text -> steps
    for f in Path(grpo).glob("completions/*.parquet"):
        df = pd.read_parquet(f)
        for step, prompt in zip(df["step"] if "step" in df else [f.stem] * len(df), df["prompt"]):
            for q in re.findall(r"^Question: (.*)$", prompt[-1]["content"], flags=re.M):
                steps[q].add(step)
    return Counter({qid: len(steps[r["question"]]) for qid, r in rl.items() if steps.get(r["question"])})


def draw_range(times: Counter, rl: Mapping[str, dict]) -> dict:
    """`draws_min`, `draws_max` over every RL question (0 for one never drawn), from `draws`."""
    if not times:  # no question in any logged prompt: prompts not logged or worded otherwise, not "drawn 0 times"
        return {"draws_min": None, "draws_max": None}
    return {"draws_min": min(times[q] for q in rl), "draws_max": max(times[q] for q in rl)}


def of_run(grpo: Path, rl: Mapping[str, dict]) -> dict:
    """Every figure of the module's docstring for the GRPO output folder `grpo`, trained on `rl`."""
    return {**training(log_history(grpo)), **draw_range(draws(grpo, rl) if rl else Counter(), rl)}


def turned(start: Mapping[str, bool], cell: Mapping[str, bool]) -> tuple[int, int]:
    """Questions the start got wrong and the cell right ("turned right"), and the reverse, over the cell's."""
    right = sum(1 for q, ok in cell.items() if ok and not start[q])
    wrong = sum(1 for q, ok in cell.items() if start[q] and not ok)
    return right, wrong
