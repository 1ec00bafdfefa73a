"""Judge predicted SQL against gold SQL by execution: the one question filter, reward and evaluation share.

Match modes (`--match`): bird and spider compare on the question's one database (matching.py); test-suite
runs gold and prediction on every database of the question's suite (`data.suite_paths`) and calls the
prediction right only if it matches under spider's rules on all of them (Zhong, Yu and Klein, EMNLP 2020).
There a gold that fails (or is over the budget) on any database of its suite cannot be compared, and a gold that
returns no rows on every database tells nothing apart (`gold_empty`): such questions are not scored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slmsql.inputs.data import Example, db_path, suite_paths
from slmsql.sql.extract import completion_text, extract_sql
from slmsql.sql.matching import Digests, results_match
from slmsql.sql.sandbox import ExecResult, Whole

# Per-example statuses: the sandbox's five, plus four that never run the prediction.
STATUSES = ("ok", "error", "timeout", "truncated", "rejected", "no_sql", "gold_error", "gold_too_large",
            "gold_empty")
# The gold cannot be compared with: the question is not scorable (the filter's `errors` bucket). gold_empty
# only under test-suite: a gold with no rows on every database of its suite.
GOLD_STATUSES = ("gold_error", "gold_too_large", "gold_empty")
TEST_SUITE = "test-suite"


@dataclass(frozen=True)
class Outcome:
    correct: bool
    status: str  # ok means "ran"; correct says whether it matched
    error: str | None = None
    pred_ms: float | None = None
    # the results, when asked for (`keep_rows`): the prediction's (SQL that ran) and the gold's, as the sandbox
    # returned them (row tuples, or matching.Digests past row_cap); what the cell rewards compare
    rows: tuple | Digests | None = field(default=None, repr=False, compare=False)
    gold_rows: tuple | Digests | None = field(default=None, repr=False, compare=False)
    # test-suite only: the verdict on the suite's first database alone (today's one-database EX); rows and
    # gold_rows are that database's
    single: bool | None = None

    @property
    def outcome(self) -> str:
        return outcome_name(self.correct, self.status)


def outcome_name(correct: bool, status: str) -> str:
    """The one name of an answer's outcome in metrics (`exec/<outcome>`) and tables (`status`): SQL that ran
    is `correct` or `wrong_result`; otherwise the status (error, timeout, no_sql, missing, ...)."""
    return "correct" if correct else ("wrong_result" if status == "ok" else status)


def read_to(gold_rows, match: str) -> Whole:
    """How far a prediction is read: whole, but no further than it can still match this gold. Value rows
    bound bird's distinct rows by their count (no need to normalise them: any prediction is read as values
    to row_cap anyway)."""
    if match in ("spider", TEST_SUITE):
        return Whole(rows=len(gold_rows))
    return Whole(distinct=gold_rows.distinct if isinstance(gold_rows, Digests) else len(gold_rows))


def judge(items, executor, match: str = "bird", keep_rows: bool = False) -> list[Outcome]:
    """items: (db_file, predicted sql or None, gold sql). Gold runs once per (db, sql) via the cache; a
    prediction runs only against a gold that ran, and is read as far as it can still match it. `keep_rows`:
    each Outcome also holds both results (off by default: a filter's many outcomes would hold every result)."""
    items = list(items)
    if match == TEST_SUITE:
        return _judge_suites(items, executor, keep_rows)
    golds = executor.run_gold([(str(db), gold) for db, _, gold in items])
    todo = [i for i, (_, pred, _) in enumerate(items) if pred is not None and golds[i].status == "ok"]
    preds = dict(zip(todo, executor.run([(str(items[i][0]), items[i][1], read_to(golds[i].rows, match))
                                         for i in todo])))
    out = []
    for i, ((_, pred, gold_sql), gold) in enumerate(zip(items, golds)):
        if gold.status == "truncated":  # a Whole read stops a gold only at the digest budget
            out.append(Outcome(False, "gold_too_large", f"gold {gold.error}"))
        elif gold.status != "ok":
            out.append(Outcome(False, "gold_error", f"gold {gold.status}: {gold.error}"))
        elif pred is None:
            out.append(Outcome(False, "no_sql"))
        else:
            r: ExecResult = preds[i]
            ok = r.status == "ok" and results_match(r.rows, gold.rows, match, gold_sql)
            kept = dict(rows=r.rows, gold_rows=gold.rows) if keep_rows else {}
            out.append(Outcome(ok, r.status, r.error, round(r.elapsed_ms, 3), **kept))
    return out


def _gold_problem(golds, dbs) -> Outcome | None:
    """Why a gold cannot judge on this suite (an Outcome naming the database), or None."""
    for g, db in zip(golds, dbs):
        if g.status == "truncated":
            return Outcome(False, "gold_too_large", f"gold on {db.name}: {g.error}")
    for g, db in zip(golds, dbs):
        if g.status != "ok":
            return Outcome(False, "gold_error", f"gold {g.status} on {db.name}: {g.error}")
    if not any(len(g.rows) for g in golds):
        return Outcome(False, "gold_empty", f"gold returns no rows on any of the suite's {len(dbs)} databases")
    return None


def _judge_suites(items, executor, keep_rows: bool) -> list[Outcome]:
    """test-suite: each (db_file, pred, gold) judged on every database of db_file's suite, one sandboxed run per
    database (the same limits each time). Right only when it ran and matched (spider's rules) on all of them."""
    folders: dict[str, list] = {}  # a batch holds many items of one database: list each folder once
    for db, _, _ in items:
        if str(db) not in folders:
            folders[str(db)] = suite_paths(db)
    suites = [folders[str(db)] for db, _, _ in items]
    flat = [(i, d) for i, dbs in enumerate(suites) for d in dbs]
    golds = executor.run_gold([(str(d), items[i][2]) for i, d in flat])
    by_q: dict[int, list] = {}
    for (i, _), g in zip(flat, golds):
        by_q.setdefault(i, []).append(g)
    problems = {i: _gold_problem(by_q[i], suites[i]) for i in range(len(items))}
    todo = [k for k, (i, _) in enumerate(flat) if items[i][1] is not None and problems[i] is None]
    ran = dict(zip(todo, executor.run([(str(flat[k][1]), items[flat[k][0]][1], read_to(golds[k].rows, "spider"))
                                       for k in todo])))
    preds: dict[int, list] = {}
    for k in todo:
        preds.setdefault(flat[k][0], []).append(ran[k])
    out = []
    for i, (_, pred, gold_sql) in enumerate(items):
        if problems[i] is not None:
            out.append(problems[i])
            continue
        if pred is None:  # wrong on one database as on all: ex_single_db counts it so
            out.append(Outcome(False, "no_sql", single=False))
            continue
        verdicts = [r.status == "ok" and results_match(r.rows, g.rows, "spider", gold_sql)
                    for r, g in zip(preds[i], by_q[i])]
        failed = next(((r, d) for r, d in zip(preds[i], suites[i]) if r.status != "ok"), None)
        status, error = ("ok", None) if failed is None else \
            (failed[0].status, f"on {failed[1].name}: {failed[0].error}")
        first, gold = preds[i][0], by_q[i][0]
        kept = dict(rows=first.rows, gold_rows=gold.rows) if keep_rows else {}
        out.append(Outcome(all(verdicts), status, error, round(sum(r.elapsed_ms for r in preds[i]), 3),
                           single=verdicts[0], **kept))
    return out


def outcomes(completions, sql, db_path, executor, match="bird", keep_rows: bool = False) -> list[Outcome]:
    """Correctness and execution status of each raw completion (the filter's pass rate, the reward)."""
    preds = [extract_sql(completion_text(c))[0] for c in completions]
    return judge(zip(db_path, preds, sql), executor, match, keep_rows)


def score_predictions(examples: list[Example], predictions: dict[str, dict], db_root, executor,
                      match: str = "bird") -> list[dict]:
    """One result row per gold example. A prediction is {"sql"} or {"completion"} (raw model text)."""
    items, hows = [], []
    for ex in examples:
        pred = predictions.get(ex.id)
        if pred is None:
            sql, how = None, "missing"
        elif pred.get("sql") is not None:
            sql, how = (pred["sql"].strip() or None), "sql"
        else:
            sql, how = extract_sql(pred.get("completion"))
        items.append((db_path(db_root, ex.db_id), sql, ex.sql))
        hows.append(how)
    rows = []
    for ex, how, (_, sql, _), o in zip(examples, hows, items, judge(items, executor, match)):
        status = "missing" if how == "missing" else o.outcome
        row = {"id": ex.id, "db_id": ex.db_id, "difficulty": ex.difficulty, "correct": o.correct,
               "status": status, "extracted_by": how, "predicted_sql": sql, "error": o.error, "pred_ms": o.pred_ms}
        if o.single is not None:  # test-suite: the one-database verdict beside the suite's
            row["single_db_correct"] = o.single
        rows.append(row)
    return rows


def split_scored(results: list[dict], match: str) -> tuple[list[dict], list[str]]:
    """(the rows EX counts, the ids it leaves out). Under test-suite a question whose gold cannot judge on its
    suite (GOLD_STATUSES) is reported by id, never counted as a wrong answer; under bird and spider every row
    counts (a gold_error scores wrong, as in both benchmarks' evaluators)."""
    if match != TEST_SUITE:
        return results, []
    out = [r["id"] for r in results if r["status"] in GOLD_STATUSES]
    return [r for r in results if r["status"] not in GOLD_STATUSES], out


def disagreement(single: list[bool], suite: list[bool]) -> float:
    """Share of answers the one-database verdict and the suite's verdict disagree on (the suite can only be
    stricter: right on every database includes the first)."""
    return sum(a != b for a, b in zip(single, suite)) / len(suite) if suite else 0.0


def result_row(row: dict) -> dict:
    """A results.jsonl row in the vocabulary of the tables and metrics (`status` an outcome name: correct,
    wrong_result, error, ...; `predicted_sql`), whichever slmsql wrote it: before, `status` was the sandbox's
    (ok for SQL that ran) and the SQL `pred_sql`."""
    row = {("predicted_sql" if k == "pred_sql" else k): v for k, v in row.items()}
    return {**row, "status": outcome_name(bool(row["correct"]), row["status"])}


def ex_summary(results: list[dict], confidence: float = 0.95) -> dict:
    """EX with its Wilson interval, per-difficulty EX, and the share of each failure outcome (`exec/<outcome>`)."""
    from slmsql.stats import inference  # scipy/statsmodels: kept off the import path that sandbox workers re-run

    n = len(results)
    k = sum(r["correct"] for r in results)
    lo, hi = inference.wilson(k, n, confidence)
    m = {"ex": k / n, "n": n, "n_correct": k, "ex_ci_low": lo, "ex_ci_high": hi}
    outcomes_ = [outcome_name(r["correct"], r["status"]) for r in results]
    for s in ("wrong_result", *STATUSES[1:], "missing"):  # `correct` is `ex`
        m[f"exec/{s}"] = outcomes_.count(s) / n
    if results and all("single_db_correct" in r for r in results):  # test-suite: what one database would say
        m["ex_single_db"] = sum(bool(r["single_db_correct"]) for r in results) / n
        m["suite_single_disagree"] = disagreement([bool(r["single_db_correct"]) for r in results],
                                                  [bool(r["correct"]) for r in results])
    for d in sorted({r.get("difficulty") for r in results if r.get("difficulty")}):
        sub = [r for r in results if r.get("difficulty") == d]
        m[f"ex_{d}"] = sum(r["correct"] for r in sub) / len(sub)
        m[f"n_{d}"] = len(sub)
    return m
