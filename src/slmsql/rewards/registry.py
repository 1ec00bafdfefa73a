"""Rewards in TRL's GRPOTrainer signature, registered under stable names.

TRL calls `fn(prompts, completions, completion_ids, trainer_state, **dataset_columns)` and logs
`rewards/<fn.__name__>/mean`, so each reward keeps the registry name as its `__name__`.
Completions come as plain strings or, for conversational data, as [{"role": "assistant", "content": ...}].

execution: 1.0 when the extracted SQL runs and matches gold, `runs` (0.1) when it runs but is wrong,
           0.0 otherwise (error, timeout, truncated, rejected, no SQL, and a gold that cannot be compared:
           gold_error, gold_too_large, gold_empty). The shape Arctic-Text2SQL-R1 uses. Under `--match test-suite`
           right means right on every database of the suite (`exec/suite_single_disagree` counts the completions
           the first database alone would have paid otherwise).
format:    0.2 when the completion holds a closed ```sql block.
syntax, schema_linking, ngram: Reasoning-SQL's partial rewards on the SQL text (rewards/sqlsim.py), no execution.
cell_precision, cell_recall, tuple_cardinality: QATCH's partial credit on the executed results (rewards/cells.py).
Each registered function's docstring says what it pays for, first line first (the docs' reward table).
Dataset columns used: `sql` (gold) and `db_path` (the SQLite file; under test-suite, the first of its suite).

The rewards that read results share one execution per completion per call: `build` binds one `Executions` to
all of them, which runs a batch once and hands the same outcomes to every reward TRL then calls on that batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from slmsql.errors import SlmsqlError
from slmsql.rewards import cells, sqlsim
from slmsql.sql.extract import completion_text, extract_sql, has_sql_block
from slmsql.sql.scoring import STATUSES, TEST_SUITE, Outcome, disagreement, outcomes


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


def telemetry(outs: list[Outcome], group_ids, suite: bool = False) -> dict[str, float]:
    """Per-batch signals TRL does not log: the execution-status mix, and the fraction of groups whose
    *correctness* varies. A group of 0.0 and 0.1 rewards has reward std > 0 but teaches nothing about
    correctness; only groups with both right and wrong answers carry that signal. `suite` (test-suite matching):
    also the share of completions that the first database alone would have paid otherwise than the suite does."""
    n = len(outs)
    names = [o.outcome for o in outs]
    # every outcome (scoring.STATUSES, `ok` split into correct and wrong_result): each step's shares sum to 1
    m = {f"exec/{s}": names.count(s) / n for s in ("correct", "wrong_result", *STATUSES[1:])}
    groups: dict = {}
    for gid, o in zip(group_ids, outs):
        groups.setdefault(gid, set()).add(o.correct)
    m["exec/frac_groups_correctness_varies"] = sum(len(v) == 2 for v in groups.values()) / len(groups)
    if suite:  # a gold that cannot judge has no single verdict: it agrees (both pay nothing)
        m["exec/suite_single_disagree"] = disagreement([bool(o.single) for o in outs], [o.correct for o in outs])
    return m


class Executions:
    """One execution per completion per reward call: TRL calls every reward function on the same batch in turn,
    so the outcomes of the last batch (completion texts, gold SQL, databases) are kept and handed back when the
    next reward asks for that same batch. `runs` counts the batches actually executed (tests, the bench)."""

    def __init__(self, executor, match: str = "bird"):
        self.executor, self.match, self.runs = executor, match, 0
        self._key, self._outs = None, None

    def outcomes(self, completions, sql, db_path) -> list[Outcome]:
        key = (tuple(completion_text(c) for c in completions), tuple(sql), tuple(map(str, db_path)))
        if key != self._key:
            self._outs = outcomes(completions, sql, db_path, self.executor, self.match, keep_rows=True)
            self._key, self.runs = key, self.runs + 1
        return self._outs


def _executed(completions, sql, db_path, executor, match, shared) -> list[Outcome]:
    return (shared or Executions(executor, match)).outcomes(completions, sql, db_path)


def execution_reward(prompts, completions, *, sql, db_path, executor=None, tiers: Tiers = Tiers(), match="bird",
                     on_outcomes=None, log_metric=None, log_extra=None, id=None, shared=None, **_) -> list[float]:
    """Whether the SQL runs and returns the gold's result: `tiers.correct` (1.0), `tiers.runs` (0.1) when it runs
    but is wrong, `tiers.fails` (0.0) otherwise. Arctic-Text2SQL-R1's outcome reward."""
    outs = _executed(completions, sql, db_path, executor, match, shared)
    if on_outcomes is not None:
        on_outcomes(outs)
    if log_metric is not None:  # TRL >= 1.x hands reward functions its metric and completions-table sinks
        for name, value in telemetry(outs, id or prompts, suite=match == TEST_SUITE).items():
            log_metric(name, value)
    if log_extra is not None:  # the completions table's `status`: named as in the exec/<outcome> metrics
        log_extra("status", [o.outcome for o in outs])
    return [execution_tier(o, tiers) for o in outs]


def format_reward(prompts, completions, *, tiers: Tiers = Tiers(), **_) -> list[float]:
    """`tiers.format` (0.2) when the completion holds a closed ```sql block, else 0.0. DeepSeek-R1-style format
    reward, as Reasoning-SQL and Arctic-Text2SQL-R1 use it."""
    return [tiers.format if has_sql_block(completion_text(c)) else 0.0 for c in completions]


def _preds(completions) -> list[str | None]:
    return [extract_sql(completion_text(c))[0] for c in completions]


def syntax_reward(prompts, completions, **_) -> list[float]:
    """1.0 when the extracted SQL parses as one SQLite query (sqlglot), else 0.0: Reasoning-SQL's syntax check,
    by parsing alone."""
    return [sqlsim.syntax(p) for p in _preds(completions)]


def schema_linking_reward(prompts, completions, *, sql, db_path, **_) -> list[float]:
    """Jaccard similarity of the tables and columns the SQL reads and those the gold reads (sqlglot: aliases,
    `*`, joins, subqueries and CTEs resolved against the database's schema): Reasoning-SQL's schema linking."""
    return [sqlsim.schema_linking(p, g, sqlsim.schema_of(str(db)))
            for p, g, db in zip(_preds(completions), sql, db_path)]


def ngram_reward(prompts, completions, *, sql, **_) -> list[float]:
    """Jaccard similarity of the SQL's token bigrams and the gold's: Reasoning-SQL's n-gram similarity (n = 2)."""
    return [sqlsim.ngram(p, g) for p, g in zip(_preds(completions), sql)]


def _on_results(measure):
    """A QATCH measure as a reward on the shared execution: SQL that did not run to a held result scores 0.0
    (an error, no SQL, a prediction stopped as too large to match, a gold that cannot be compared)."""

    def reward(prompts, completions, *, sql, db_path, executor=None, match="bird", shared=None, **_) -> list[float]:
        outs = _executed(completions, sql, db_path, executor, match, shared)
        return [measure(o.rows, o.gold_rows) if o.status == "ok" and o.rows is not None and o.gold_rows is not None
                else 0.0 for o in outs]

    first = measure.__doc__.split("\n\n")[0]
    reward.__doc__ = f"{first}\n\nOn the shared execution's results: 0.0 for SQL that did not run to a result."
    reward.__name__ = reward.__qualname__ = f"{measure.__name__}_reward"
    return reward


cell_precision_reward = _on_results(cells.cell_precision)
cell_recall_reward = _on_results(cells.cell_recall)
tuple_cardinality_reward = _on_results(cells.tuple_cardinality)

REGISTRY = {"execution": execution_reward, "format": format_reward, "syntax": syntax_reward,
            "schema_linking": schema_linking_reward, "ngram": ngram_reward, "cell_precision": cell_precision_reward,
            "cell_recall": cell_recall_reward, "tuple_cardinality": tuple_cardinality_reward}


def describe(name: str) -> str:
    """A registered reward's one-paragraph description: its docstring's first paragraph, on one line."""
    return " ".join(REGISTRY[name].__doc__.split("\n\n")[0].split())


def check(names, weights=()) -> None:
    """Reward names must be registered, and weights (if any) one per reward: checked before a model loads."""
    unknown = [n for n in names if n not in REGISTRY]
    if unknown or not names:
        raise RewardError(f"unknown reward(s) {unknown or list(names)}; registered: {sorted(REGISTRY)}")
    if weights and len(weights) != len(names):
        raise RewardError(f"{len(weights)} reward weights for {len(names)} rewards ({list(names)})")


def build(names, **bound):
    """Reward callables for TRL, each named after its registry key, so metrics read `rewards/execution/mean`.
    All of them share one `Executions` (one run of each batch's SQL, whichever rewards read results).

    Closures rather than functools.partial: TRL unwraps partials to the inner function's name."""
    check(names)
    if "executor" in bound and "shared" not in bound:
        bound = {**bound, "shared": Executions(bound["executor"], bound.get("match", "bird"))}

    def bind(name):
        target = REGISTRY[name]

        @functools.wraps(target)
        def reward(prompts, completions, **columns):
            return target(prompts, completions, **bound, **columns)

        reward.__name__ = reward.__qualname__ = name
        return reward

    return [bind(n) for n in names]
