"""Rewards in TRL's GRPOTrainer signature, registered under stable names.

TRL calls `fn(prompts, completions, completion_ids, trainer_state, **dataset_columns)` and logs
`rewards/<fn.__name__>/mean`, so each reward keeps the registry name as its `__name__`.
Completions come as plain strings or, for conversational data, as [{"role": "assistant", "content": ...}].

execution: 1.0 when the extracted SQL runs and matches gold, `runs` (0.1) when it runs but is wrong,
           0.0 otherwise (error, timeout, truncated, rejected, no SQL, and a gold that cannot be compared:
           gold_error, gold_too_large). The shape Arctic-Text2SQL-R1 uses.
format:    0.2 when the completion holds a closed ```sql block.
Dataset columns used: `sql` (gold) and `db_path` (the SQLite file).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .errors import SlmsqlError
from .extract import completion_text, has_sql_block
from .scoring import STATUSES, Outcome, outcomes


class RewardError(SlmsqlError, ValueError):
    """A reward set-up no run could use."""


@dataclass(frozen=True)
class Tiers:
    correct: float = 1.0
    runs: float = 0.1
    fails: float = 0.0
    format: float = 0.2


def execution_tier(o: Outcome, tiers: Tiers = Tiers()) -> float:
    if o.correct:
        return tiers.correct
    return tiers.runs if o.status == "ok" else tiers.fails


def telemetry(outs: list[Outcome], group_ids) -> dict[str, float]:
    """Per-batch signals TRL does not log: the execution-status mix, and the fraction of groups whose
    *correctness* varies. A group of 0.0 and 0.1 rewards has reward std > 0 but teaches nothing about
    correctness; only groups with both right and wrong answers carry that signal."""
    n = len(outs)
    names = [o.outcome for o in outs]
    # every outcome (scoring.STATUSES, `ok` split into correct and wrong_result): each step's shares sum to 1
    m = {f"exec/{s}": names.count(s) / n for s in ("correct", "wrong_result", *STATUSES[1:])}
    groups: dict = {}
    for gid, o in zip(group_ids, outs):
        groups.setdefault(gid, set()).add(o.correct)
    m["exec/frac_groups_correctness_varies"] = sum(len(v) == 2 for v in groups.values()) / len(groups)
    return m


def execution_reward(prompts, completions, *, sql, db_path, executor, tiers: Tiers = Tiers(), match="bird",
                     on_outcomes=None, log_metric=None, log_extra=None, id=None, **_) -> list[float]:
    outs = outcomes(completions, sql, db_path, executor, match)
    if on_outcomes is not None:
        on_outcomes(outs)
    if log_metric is not None:  # TRL >= 1.x hands reward functions its metric and completions-table sinks
        for name, value in telemetry(outs, id or prompts).items():
            log_metric(name, value)
    if log_extra is not None:  # the completions table's `status`: named as in the exec/<outcome> metrics
        log_extra("status", [o.outcome for o in outs])
    return [execution_tier(o, tiers) for o in outs]


def format_reward(prompts, completions, *, tiers: Tiers = Tiers(), **_) -> list[float]:
    return [tiers.format if has_sql_block(completion_text(c)) else 0.0 for c in completions]


REGISTRY = {"execution": execution_reward, "format": format_reward}


def check(names, weights=()) -> None:
    """Reward names must be registered, and weights (if any) one per reward: checked before a model loads."""
    unknown = [n for n in names if n not in REGISTRY]
    if unknown or not names:
        raise RewardError(f"unknown reward(s) {unknown or list(names)}; registered: {sorted(REGISTRY)}")
    if weights and len(weights) != len(names):
        raise RewardError(f"{len(weights)} reward weights for {len(names)} rewards ({list(names)})")


def build(names, **bound):
    """Reward callables for TRL, each named after its registry key, so metrics read `rewards/execution/mean`.

    Closures rather than functools.partial: TRL unwraps partials to the inner function's name."""
    check(names)

    def bind(name):
        target = REGISTRY[name]

        @functools.wraps(target)
        def reward(prompts, completions, **columns):
            return target(prompts, completions, **bound, **columns)

        reward.__name__ = reward.__qualname__ = name
        return reward

    return [bind(n) for n in names]
