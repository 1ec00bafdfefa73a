"""Gold data: the canonical JSONL, plus BIRD's and Spider's dev.json read natively.

Canonical line: {"id", "db_id", "question", "sql", "evidence"?, "difficulty"?, ...extra}.
Databases live at <db_root>/<db_id>/<db_id>.sqlite, the layout both benchmarks ship; a db_id is a name,
never a path (`db_id_problem`). Under `--match test-suite` a question's databases are every `*.sqlite` in that
folder (`suite_paths`: the layout of Spider's released test suites), `<db_id>.sqlite` first; prompts and the
one-database EX use that first one.

Every JSON and JSONL file slmsql writes goes through `dumps` (see there for the one rule on text UTF-8
cannot encode); tables shown in MLflow go through `safe_text`.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
from dataclasses import asdict, dataclass, field
from pathlib import Path

from slmsql.errors import DataError, SlmsqlError

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
    if why := db_id_problem(rec["db_id"]):
        raise DataError(why, path, line, "db_id")
    extra = {k: v for k, v in rec.items() if k not in (*REQUIRED, "evidence", "difficulty")}
    return Example(str(rec["id"]), rec["db_id"], rec["question"], rec["sql"],
                   rec.get("evidence") or None, rec.get("difficulty"), extra)


def example_from_json(text: str) -> Example:
    """The Example whose `to_json()` was written as `text` (a row passed between processes)."""
    return _from_record(json.loads(text), "<example>", None)


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


def questions(path, db_ids=(), limit: int = 0) -> list[Example]:
    """The questions a stage takes from gold file `path`: those on the databases `db_ids` names (all when empty;
    a split of a benchmark by database, as a study declares it), then the first `limit` of them (0: all). Ids are
    the file's own, so a split's questions keep the ids they have in the whole file."""
    examples = read_gold(path)
    if db_ids:
        unknown = sorted(set(db_ids) - {e.db_id for e in examples})
        if unknown:
            raise DataError(f"no question of {path} is on database(s) {unknown}", "command line", field="db_ids")
        examples = [e for e in examples if e.db_id in set(db_ids)]
    return examples[:limit or None]


def db_id_problem(db_id) -> str | None:
    """Why `db_id` cannot name a database, or None. A db_id is joined into a path under --db-root, so it must
    be a plain name: non-empty, no '/' or '\\', not '.' or '..', no NUL (`../../x` would look outside)."""
    if not isinstance(db_id, str) or not db_id.strip():
        return f"db_id {db_id!r} is not a database name: empty or not a string"
    if "/" in db_id or "\\" in db_id or "\0" in db_id or db_id in (".", ".."):
        return f"db_id {db_id!r} is not a database name: no '/', '\\', NUL, '.' or '..'"
    return None


def db_path(db_root, db_id: str) -> Path:
    if why := db_id_problem(db_id):  # read_gold refuses these already; this guards every other caller
        raise DataError(why, field="db_id")
    return Path(db_root) / db_id / f"{db_id}.sqlite"


def suite_paths(db_file) -> list[Path]:
    """A test suite: every `*.sqlite` in the folder of `db_file` (a question's `db_path`), `db_file` itself first
    (the one database of today's EX), the others in name order. A folder holding only `db_file` is a suite of one."""
    db_file = Path(db_file)
    others = sorted(p for p in db_file.parent.glob("*.sqlite") if p.name != db_file.name and p.is_file())
    return [db_file, *others]


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


# ---- writing JSON ------------------------------------------------------------------------------------
# Python strings may hold lone surrogates (U+D800..U+DFFF): a JSON "\ud800" escape in a gold or predictions
# file decodes to one, and so does an undecodable byte under surrogateescape (argv, file names). UTF-8 has
# no bytes for them, so `json.dumps(..., ensure_ascii=False)` written as UTF-8 raises UnicodeEncodeError,
# at the end of a run, after everything was scored.
_SURROGATE = re.compile("[\ud800-\udfff]")


def dumps(obj, **kwargs) -> str:
    """JSON text that always encodes as UTF-8 and reads back (json.loads, read_jsonl, read_gold) as the
    same Python strings. The one rule for every JSON and JSONL file slmsql writes:

    text is written as UTF-8 as it is (readable; byte-identical to `json.dumps(ensure_ascii=False)` for any
    text UTF-8 can encode), and each lone surrogate, the only thing it cannot, as its JSON escape `\\udXXX`,
    which json.loads turns back into the same code unit. Outside string literals json.dumps writes only ASCII,
    and it escapes backslashes, so a raw surrogate in its output is always a whole character inside a string.
    One limit, JSON's own: a high and a low surrogate held as two code units next to each other read back
    as the one character they encode (JSON cannot tell the two apart)."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(obj, ensure_ascii=False, **kwargs))


def safe_text(value):
    """A copy of `value` (a string, or dicts/lists/tuples holding strings) with each lone surrogate replaced
    by U+FFFD, for what must encode and is never read back as data: MLflow tables and dataset digests,
    Markdown reports, and pandas frames (pandas 3 keeps text in Arrow, which refuses lone surrogates:
    `pd.DataFrame` of such a string raises). The exact text stays in the JSON and JSONL files."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {safe_text(k): safe_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(safe_text(v) for v in value)
    return value


def _write_atomic(path, chunks) -> None:
    """A crash never leaves a half-written file under the final name."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(chunks)
    os.replace(tmp, path)


def write_jsonl(path, rows) -> None:
    _write_atomic(path, (dumps(r.to_json() if isinstance(r, Example) else r) + "\n" for r in rows))


def write_json(path, obj, **kwargs) -> None:
    """One JSON document, indented (summary.json, metrics.json, ...); kwargs go to json.dumps (e.g. default)."""
    _write_atomic(path, [dumps(obj, indent=2, **kwargs) + "\n"])


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


def load_finished(path: Path, examples) -> dict[str, dict]:
    """id -> row of every question already finished (the filter's pass-rate rows, evaluate's answers), in any
    order (samples are keyed by question id, so which were done first, and by which engine, does not matter).
    A torn last line (kill -9 during a write) is dropped and the file rewritten without it; a row for a question
    not in the source, or twice, means the folder belongs to other data."""
    if not path.exists():
        return {}
    ids = {e.id for e in examples}
    done: dict[str, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        if row.get("id") not in ids or row["id"] in done:
            raise SlmsqlError(f"{path} does not match the source questions (row {row.get('id')!r}); "
                              f"delete {path.parent} to start over")
        done[row["id"]] = row
    write_jsonl(path, done.values())
    return done
