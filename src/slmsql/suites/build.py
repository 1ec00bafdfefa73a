"""Building one database's test suite: candidates generated (fill.py), judged against each gold's neighbours, distilled.

For one db_id: its schema (tables.json), its golds' literal pools, each gold's neighbours (neighbours.py). A gold
or a neighbour that does not run on the schema itself (an empty database of it: "no such column" needs no rows)
leaves the count: such a gold is listed as failed, such a neighbour is not one a suite can tell apart. Then
candidates one by one, in index order: each runs every gold (a candidate where a gold fails, times out or is too
large is skipped: on a kept database it would make that question unscorable) and every neighbour, judged by the
project's one comparison (sql.scoring.judge, spider's rules, the sandbox's limits) on the pairs no pooled database
tells apart yet, and offered to `distill.Distiller`, which pools it or not; all `candidates` are generated unless
the pool has told every pair apart and filled every gold. The Distiller then selects up to `cap` of the pool.
Kept databases become `<db_id>.sqlite` (the first chosen: what one-database EX uses), `<db_id>_1.sqlite`, ...
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import sqlglot

from slmsql.errors import DataError
from slmsql.inputs.data import read_gold
from slmsql.inputs.prompts import read_tables_json
from slmsql.sql.scoring import judge
from slmsql.suites import fill
from slmsql.suites.distill import Candidate, Distiller
from slmsql.suites.neighbours import neighbours
from slmsql.suites.pools import literal_pools
from slmsql.suites.schema import Schema


@dataclass(frozen=True)
class Params:
    seed: int = 0
    cap: int = 20            # databases kept per db_id at most
    candidates: int = 300    # candidates generated per db_id at most
    sizes: tuple = (5, 30)   # each candidate's tables hold 1..bound rows, bound drawn from these


@dataclass
class Suite:
    db_id: str
    files: list[dict] = field(default_factory=list)      # {name, sha256, content_sha256, bytes}
    questions: list[dict] = field(default_factory=list)  # {id, db_id, n_neighbours, told_apart, coverage}
    empty: list[dict] = field(default_factory=list)      # {id, reason}: no rows on any kept database
    failed: list[dict] = field(default_factory=list)     # {id, reason}: does not run on the schema
    looked_at: int = 0
    skipped: list[dict] = field(default_factory=list)    # {candidate, reason}
    seconds: float = 0.0


def read_inputs(tables, data, db_ids=()) -> tuple[dict[str, dict], dict[str, list]]:
    """(db_id -> tables.json entry, db_id -> its questions), every problem refused naming file, line and field: a
    missing or malformed file, a db_id tables.json lacks, a gold sqlglot cannot parse, an unknown --db-ids name."""
    entries = read_tables_json(tables)
    path = Path(data)
    examples = read_gold(path)
    text = path.read_text(encoding="utf-8")
    # the line read_gold's records came from: a JSON list's record index, a JSONL file's line
    lines = list(range(len(examples))) if path.suffix == ".json" else \
        [n for n, raw in enumerate(text.splitlines(), 1) if raw.strip()]
    sql_field = "query" if path.suffix == ".json" else "sql"
    by_db: dict[str, list] = {}
    for ex, line in zip(examples, lines):
        if db_ids and ex.db_id not in db_ids:
            continue
        if ex.db_id not in entries:
            raise DataError(f"unknown db_id {ex.db_id!r}: not in {tables}", path, line, "db_id")
        try:
            sqlglot.parse_one(ex.sql, read="sqlite")
        except sqlglot.errors.SqlglotError as e:
            raise DataError(f"sqlglot cannot parse the gold: {str(e).splitlines()[0]}", path, line, sql_field) from None
        by_db.setdefault(ex.db_id, []).append(ex)
    missing = [d for d in db_ids if d not in by_db]
    if missing:
        raise DataError(f"no questions of {missing} in {data}", "command line", field="db_ids")
    if not by_db:
        raise DataError("no questions", path)
    return {d: entries[d] for d in by_db}, by_db


def _runs(executor, db, sqls) -> list:
    return executor.run([(str(db), s) for s in sqls])


def build_suite(entry: dict, questions: list, folder: Path, scratch: Path, params: Params, executor,
                advance=lambda: None, source=None) -> Suite:
    """Write `folder`/<db_id>*.sqlite for one db_id; `scratch` (a folder of its own, removed at the end) holds the
    candidates meanwhile, each path used once: the sandbox's workers keep connections by path. `advance()` is
    called per candidate looked at."""
    t0 = time.perf_counter()
    schema = Schema(entry, source)
    db_id = entry["db_id"]
    out = Suite(db_id)
    pools = literal_pools(schema, [q.sql for q in questions])
    columns = schema.table_columns()
    scratch.mkdir(parents=True, exist_ok=True)
    empty_db = scratch / f"{db_id}.schema.sqlite"
    fill.write(empty_db, schema, {})
    live, near = [], {}
    for q, r in zip(questions, _runs(executor, empty_db, [q.sql for q in questions])):
        if r.status != "ok":
            out.failed.append({"id": q.id, "reason": f"gold does not run on the schema: {r.status}: {r.error}"})
            continue
        cands = [n.sql for n in neighbours(q.sql, columns)]
        near[q.id] = [s for s, nr in zip(cands, _runs(executor, empty_db, cands)) if nr.status == "ok"]
        live.append(q)

    dist = Distiller({q.id: len(near[q.id]) for q in live}, params.cap)
    for i in range(params.candidates):
        if dist.complete:
            break
        path = scratch / f"{db_id}.candidate{i:04d}.sqlite"
        fill.write(path, schema, fill.generate(schema, pools, list(params.sizes), fill.rng_for(params.seed, db_id, i)))
        out.looked_at += 1
        advance()
        golds = executor.run_gold([(str(path), q.sql) for q in live])
        bad = next(((q, g) for q, g in zip(live, golds) if g.status != "ok"), None)
        if bad is not None:
            out.skipped.append({"candidate": i, "reason": f"gold {bad[0].id}: {bad[1].status}: {bad[1].error}"})
            continue
        # only the pairs no pooled database tells apart yet: the others cannot pool this one (Distiller)
        pairs = [(q, j) for q in live for j in range(len(near[q.id])) if (q.id, j) not in dist.told]
        outs = judge([(path, near[q.id][j], q.sql) for q, j in pairs], executor, "spider")
        apart = frozenset((q.id, j) for (q, j), o in zip(pairs, outs) if o.status == "ok" and not o.correct)
        dist.offer(Candidate(str(path), apart, frozenset(q.id for q, g in zip(live, golds) if len(g.rows))))
    d = dist.result()
    folder.mkdir(parents=True, exist_ok=True)
    for k, name in enumerate(d.kept):
        target = folder / (f"{db_id}.sqlite" if k == 0 else f"{db_id}_{k}.sqlite")
        Path(name).replace(target)
        out.files.append({"name": f"{db_id}/{target.name}", "sha256": fill.file_digest(target),
                          "content_sha256": fill.content_digest(target), "bytes": target.stat().st_size})
    shutil.rmtree(scratch)  # the candidates not kept
    out.empty = [{"id": q, "reason": f"its gold returns no rows on any of the {out.looked_at} generated databases "
                  "looked at"} for q in d.empty]
    failed, empty = {f["id"] for f in out.failed}, set(d.empty)
    for q in questions:
        n, cov = len(near.get(q.id, ())), d.coverage.get(q.id)
        out.questions.append({"id": q.id, "db_id": db_id, "status": "failed" if q.id in failed else
                              "empty" if q.id in empty else "ok", "n_neighbours": n,
                              "told_apart": None if cov is None else round(cov * n), "coverage": cov})
    if not d.kept:
        raise DataError(f"no generated database of {db_id} could be kept ({len(out.skipped)} of {out.looked_at} "
                        f"skipped; first: {out.skipped[0]['reason'] if out.skipped else 'none'})", source)
    out.seconds = round(time.perf_counter() - t0, 3)
    return out


def _quantile(sorted_values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation between order statistics (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summary(suites: list[Suite]) -> dict:
    """The figures a run logs: counts, and the coverage (share of a question's neighbours its suite tells apart)
    over the questions that have neighbours, as mean, min and quantiles, and pooled over all neighbours."""
    qs = [q for s in suites for q in s.questions]
    cov = sorted(q["coverage"] for q in qs if q["coverage"] is not None)
    n_near = sum(q["n_neighbours"] for q in qs)
    out = {"n_dbs": len(suites), "n_files": sum(len(s.files) for s in suites), "n_questions": len(qs),
           "n_empty": sum(len(s.empty) for s in suites), "n_gold_failed": sum(len(s.failed) for s in suites),
           "n_neighbours": n_near, "n_told_apart": sum(q["told_apart"] or 0 for q in qs),
           "candidates_looked_at": sum(s.looked_at for s in suites),
           "candidates_skipped": sum(len(s.skipped) for s in suites)}
    out["told_apart_share"] = out["n_told_apart"] / n_near if n_near else None
    if cov:
        out.update({"coverage_mean": sum(cov) / len(cov), "coverage_min": cov[0], "coverage_p10": _quantile(cov, 0.1),
                    "coverage_p25": _quantile(cov, 0.25), "coverage_median": _quantile(cov, 0.5),
                    "coverage_full_share": sum(c == 1 for c in cov) / len(cov)})
    return out


def manifest(params: Params, suites: list[Suite], sources: dict) -> dict:
    """manifest.json: the parameters (and the SQLite library that wrote the files: a file's sha256 holds under
    it; `content_sha256` under any), each file's hashes, each question's neighbours and coverage, the questions
    whose gold is empty on every kept database or does not run, per db_id what was looked at, and the summary."""
    import sqlite3

    return {
        "method": "test suites after Zhong, Yu and Klein (EMNLP 2020), built by slmsql (docs/stages/suite.md)",
        "parameters": {"seed": params.seed, "cap": params.cap, "candidates": params.candidates,
                       "sizes": list(params.sizes), "sqlite_version": sqlite3.sqlite_version, **sources},
        "files": [{**f, "db_id": s.db_id} for s in suites for f in s.files],
        "questions": [q for s in suites for q in s.questions],
        "empty": [{**e, "db_id": s.db_id} for s in suites for e in s.empty],
        "failed": [{**e, "db_id": s.db_id} for s in suites for e in s.failed],
        "databases": {s.db_id: {"files": len(s.files), "looked_at": s.looked_at, "skipped": s.skipped}
                      for s in suites},  # no times: the same seed gives the same manifest, byte for byte
        "summary": summary(suites),
    }
