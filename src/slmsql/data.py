"""Gold data: the canonical JSONL, plus BIRD's and Spider's dev.json read natively.

Canonical line: {"id", "db_id", "question", "sql", "evidence"?, "difficulty"?, ...extra}.
Databases live at <db_root>/<db_id>/<db_id>.sqlite, the layout both benchmarks ship.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import DataError

DIFFICULTIES = ("simple", "moderate", "challenging")
REQUIRED = ("id", "db_id", "question", "sql")


@dataclass
class Example:
    id: str
    db_id: str
    question: str
    sql: str
    evidence: str | None = None
    difficulty: str | None = None
    extra: dict = field(default_factory=dict)  # pass_rate, k, ... carried through untouched

    def to_json(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        return {k: v for k, v in {**d, **extra}.items() if v is not None}


def _from_record(rec, path, line: int | None) -> Example:
    if not isinstance(rec, dict):
        raise DataError("expected a JSON object", path, line)
    for name in REQUIRED:
        value = rec.get(name)
        if value is None or (isinstance(value, str) and not value.strip()):
            raise DataError("missing or empty", path, line, name)
    for name in ("db_id", "question", "sql"):
        if not isinstance(rec[name], str):
            raise DataError(f"must be a string, got {type(rec[name]).__name__}", path, line, name)
    extra = {k: v for k, v in rec.items() if k not in (*REQUIRED, "evidence", "difficulty")}
    return Example(str(rec["id"]), rec["db_id"], rec["question"], rec["sql"],
                   rec.get("evidence") or None, rec.get("difficulty"), extra)


def native_record(rec: dict, i: int) -> dict:
    """Map a BIRD (`question_id`, `SQL`) or Spider (`query`) record onto the canonical keys."""
    out = dict(rec)
    if "SQL" in rec:  # BIRD
        out["sql"] = rec["SQL"]
        out.setdefault("id", rec.get("question_id", i))
    elif "query" in rec:  # Spider: no ids; the position is the id evaluators use
        out["sql"] = rec["query"]
        out.setdefault("id", i)
    for k in ("SQL", "query", "question_id", "query_toks", "query_toks_no_value", "question_toks", "sql"):
        if k != "sql":
            out.pop(k, None)
    if isinstance(out.get("sql"), dict):  # Spider's parsed "sql" tree must not shadow the query text
        out["sql"] = rec["query"]
    return out


def read_gold(path) -> list[Example]:
    """Read a gold file (canonical .jsonl, or BIRD/Spider .json), check ids unique and fields present."""
    path = Path(path)
    if not path.is_file():
        raise DataError("no such file", path)
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise DataError("file is empty", path)
    examples: list[Example] = []
    if path.suffix == ".json":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"malformed JSON: {e.msg}", path, e.lineno) from None
        if not isinstance(records, list):
            raise DataError("expected a JSON list of questions (BIRD/Spider dev.json)", path)
        # JSON arrays have no line per record; name the record index as the "line".
        examples = [_from_record(native_record(r, i) if isinstance(r, dict) else r, path, i)
                    for i, r in enumerate(records)]
    else:
        for n, raw in enumerate(text.splitlines(), 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError as e:
                raise DataError(f"malformed JSON: {e.msg}", path, n) from None
            examples.append(_from_record(rec, path, n))
    seen: dict[str, int] = {}
    for n, ex in enumerate(examples, 1):
        if ex.id in seen:
            raise DataError(f"duplicate id {ex.id!r} (first at record {seen[ex.id]})", path, n, "id")
        seen[ex.id] = n
    return examples


def db_path(db_root, db_id: str) -> Path:
    return Path(db_root) / db_id / f"{db_id}.sqlite"


def check_databases(examples: list[Example], db_root, source=None) -> None:
    """Every db_id must name a real SQLite file: fail before any model or pool starts."""
    checked: set[str] = set()
    for ex in examples:
        if ex.db_id in checked:
            continue
        p = db_path(db_root, ex.db_id)
        if not p.is_file():
            raise DataError(f"unknown db_id {ex.db_id!r}: no database at {p}", source, field="db_id")
        with open(p, "rb") as f:
            if f.read(16) != b"SQLite format 3\x00":
                raise DataError(f"{p} is not an SQLite database", source, field="db_id")
        checked.add(ex.db_id)


def read_predictions(path, gold_ids: set[str]) -> dict[str, dict]:
    preds: dict[str, dict] = {}
    for n, row in enumerate(read_jsonl(path), 1):
        if not isinstance(row, dict) or row.get("id") is None:
            raise DataError("missing", path, n, "id")
        if not isinstance(row.get("sql"), str) and not isinstance(row.get("completion"), str):
            raise DataError("needs a string 'sql' or 'completion'", path, n, "sql")
        pid = str(row["id"])
        if pid in preds:
            raise DataError(f"duplicate id {pid!r}", path, n, "id")
        if pid not in gold_ids:
            raise DataError(f"id {pid!r} is not in the gold file", path, n, "id")
        preds[pid] = row
    if not preds:
        raise DataError("no predictions", path)
    return preds


def write_jsonl(path, rows) -> None:
    """Write atomically: a crash never leaves a half-written file under the final name."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row.to_json() if isinstance(row, Example) else row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_jsonl(path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise DataError("no such file", path)
    rows = []
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if raw.strip():
            try:
                rows.append(json.loads(raw))
            except json.JSONDecodeError as e:
                raise DataError(f"malformed JSON: {e.msg}", path, n) from None
    return rows


def schema_of(db_file) -> list[tuple[str, str]]:
    """(table name, CREATE statement) for every user table, read-only."""
    con = sqlite3.connect(f"file:{db_file}?mode=ro", uri=True)
    try:
        return con.execute("SELECT name, sql FROM sqlite_master WHERE type='table' "
                           "AND name NOT LIKE 'sqlite_%' ORDER BY rowid").fetchall()
    finally:
        con.close()
