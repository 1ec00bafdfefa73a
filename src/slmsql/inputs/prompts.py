"""Prompts: the database schema as CREATE TABLE text, plus the question, as chat messages.

The schema format is OmniSQL's (the format its Qwen2.5-Coder models were trained on): one column per line,
a few example values as an SQL comment, then the primary key and foreign keys as table constraints:

    CREATE TABLE book (
        book_id INTEGER, -- example: [1, 2]
        title TEXT, -- example: ['Silent River', 'Iron Comet']
        author_id INTEGER, -- example: [3, 1]
        PRIMARY KEY (book_id),
        CONSTRAINT fk_book_author_id FOREIGN KEY (author_id) REFERENCES author (author_id)
    );

`style="compact"` renders each table as one line, keys inline and no example values
(`CREATE TABLE book (book_id INTEGER PRIMARY KEY, title TEXT, author_id INTEGER REFERENCES author(author_id));`)
and drops the system message: the embedded tiny model pays for every prompt token on 2 CPU cores, so its
prompts stay near 100 tokens instead of ~250. Real models use the default OmniSQL style (see `recipes/`).

When a schema is longer than `max_chars` (MAX_CHARS in PromptBuilder), example values go first (fewer per
column, then none); whole tables are cut only after that (in either style: compact has no examples, so it
only cuts tables), the returned dict says what was dropped, and PromptBuilder logs a warning per database.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sqlite3
from pathlib import Path

from slmsql.errors import DataError, SlmsqlError
from slmsql.inputs.data import db_path, safe_text, schema_of

log = logging.getLogger(__name__)
MAX_CHARS = 12_000  # ~3-4k tokens of schema: leaves room for the answer in a 4k-8k context
SYSTEM = "You are a SQLite expert. You answer questions about a database by writing one SQLite query."
STYLES = ("omnisql", "compact")
INSTRUCTION = "Answer with one SQLite query in a ```sql code block."
_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_EXAMPLE_CHARS = 40  # long text values (descriptions, URLs) are cut: they cost tokens and help little


@functools.lru_cache(maxsize=4096)
def quote(name: str) -> str:
    """Backticks where SQLite needs them: spaces, odd characters, reserved words (SQLite itself decides)."""
    if _PLAIN.match(name):
        con = sqlite3.connect(":memory:")
        try:
            con.execute(f'SELECT {name} FROM (SELECT 1 AS "{name}")')
            return name
        except sqlite3.Error:
            pass
        finally:
            con.close()
    return "`" + name.replace("`", "``") + "`"


def _example(v) -> str:
    if isinstance(v, str):
        v = " ".join(v.split())
        v = v if len(v) <= _EXAMPLE_CHARS else v[:_EXAMPLE_CHARS].rstrip() + "..."
    return repr(v)  # Python's list style, as OmniSQL prints them


def _render(tables: list[dict], k: int) -> list[str]:
    """One CREATE TABLE block per table: {name, columns: [(name, type, examples)], pk: [..], fks: [..]}."""
    blocks = []
    for t in tables:
        rows = []  # (definition, comment): the comma goes between them
        for name, typ, examples in t["columns"]:
            comment = f" -- example: [{', '.join(_example(v) for v in examples[:k])}]" if k and examples else ""
            rows.append((f"    {quote(name)} {typ}".rstrip(), comment))
        if t["pk"]:
            rows.append((f"    PRIMARY KEY ({', '.join(quote(c) for c in t['pk'])})", ""))
        for col, ref_table, ref_col in t["fks"]:
            fk = re.sub(r"\W+", "_", f"fk_{t['name']}_{col}").lower()
            ref = f"{quote(ref_table)} ({quote(ref_col)})"
            rows.append((f"    CONSTRAINT {fk} FOREIGN KEY ({quote(col)}) REFERENCES {ref}", ""))
        body = "\n".join(d + ("," if i < len(rows) - 1 else "") + c for i, (d, c) in enumerate(rows))
        blocks.append(f"CREATE TABLE {quote(t['name'])} (\n{body}\n);")
    return blocks


def _render_compact(tables: list[dict]) -> list[str]:
    """One line per table."""
    lines = []
    for t in tables:
        fks = {col: (ref_t, ref_c) for col, ref_t, ref_c in t["fks"]}
        cols = []
        for name, typ, _ in t["columns"]:
            col = f"{quote(name)} {typ}".rstrip()
            if t["pk"] == [name]:
                col += " PRIMARY KEY"
            if name in fks:
                col += f" REFERENCES {quote(fks[name][0])}({quote(fks[name][1])})"
            cols.append(col)
        if len(t["pk"]) > 1:
            cols.append(f"PRIMARY KEY ({', '.join(quote(c) for c in t['pk'])})")
        lines.append(f"CREATE TABLE {quote(t['name'])} ({', '.join(cols)});")
    return lines


def _whole_tables(blocks: list[str], max_chars: int) -> str:
    """The leading tables that fit whole; when not even the first fits, its first max_chars characters."""
    kept: list[str] = []
    for block in blocks:
        if len("\n".join([*kept, block])) > max_chars:
            break
        kept.append(block)
    return "\n".join(kept) if kept else blocks[0][:max_chars]


def _fit(tables: list[dict], example_values: int, max_chars: int | None) -> tuple[str, dict]:
    info = {"example_values": example_values, "dropped_examples": False, "truncated_schema": False}
    for k in range(example_values, -1, -1):
        text = "\n".join(_render(tables, k))
        info["example_values"] = k
        if max_chars is None or len(text) <= max_chars:
            info["dropped_examples"] = k < example_values
            info["chars"] = len(text)
            return text, info
    # Even without examples it does not fit: keep whole tables while they fit, then cut.
    text = _whole_tables(_render(tables, 0), max_chars)
    info.update(dropped_examples=example_values > 0, truncated_schema=True, chars=len(text))
    return text, info


def _fit_compact(tables: list[dict], max_chars: int | None) -> tuple[str, dict]:
    """The same guard for compact prompts, which carry no example values: only whole tables can go."""
    lines = _render_compact(tables)
    text = "\n".join(lines)
    truncated = max_chars is not None and len(text) > max_chars
    if truncated:
        text = _whole_tables(lines, max_chars)
    return text, {"example_values": 0, "dropped_examples": False, "truncated_schema": truncated, "chars": len(text)}


def _fit_style(tables: list[dict], example_values: int, max_chars: int | None, style: str) -> tuple[str, dict]:
    return _fit_compact(tables, max_chars) if style == "compact" else _fit(tables, example_values, max_chars)


def _read_db(db_file, n: int) -> list[dict]:
    db_file = Path(db_file)
    if not db_file.is_file():
        raise DataError("no such database", db_file)
    tables = []
    con = sqlite3.connect(f"file:{db_file}?mode=ro", uri=True)
    try:
        for name, _ in schema_of(db_file):
            q = '"' + name.replace('"', '""') + '"'
            info = con.execute(f"PRAGMA table_info({q})").fetchall()  # cid, name, type, notnull, default, pk
            pk = [r[1] for r in sorted((r for r in info if r[5]), key=lambda r: r[5])]
            columns = []
            for _, col, typ, *_ in info:
                c = '"' + col.replace('"', '""') + '"'
                examples = [r[0] for r in con.execute(
                    f"SELECT DISTINCT {c} FROM {q} WHERE {c} IS NOT NULL LIMIT {n}") if not isinstance(r[0], bytes)]
                columns.append((col, typ, examples))
            fks = []
            position = {r[1]: r[0] for r in info}  # list foreign keys in column order, as declared
            rows = con.execute(f"PRAGMA foreign_key_list({q})").fetchall()  # id, seq, table, from, to, ...
            for row in sorted(rows, key=lambda r: (position.get(r[3], len(position)), r[1])):
                ref_table, col, ref_col = row[2], row[3], row[4]
                if ref_col is None:  # "REFERENCES parent" without a column names the parent's primary key
                    ref_q = '"' + ref_table.replace('"', '""') + '"'
                    ref_pk = [r for r in con.execute(f"PRAGMA table_info({ref_q})") if r[5]]
                    ref_col = ref_pk[0][1] if ref_pk else col
                fks.append((col, ref_table, ref_col))
            tables.append({"name": name, "columns": columns, "pk": pk, "fks": fks})
    except sqlite3.DatabaseError as e:
        raise DataError(f"cannot read schema: {e}", db_file) from None
    finally:
        con.close()
    return tables


def schema_text(db_file, example_values: int = 3, max_chars: int | None = None,
                style: str = "omnisql") -> tuple[str, dict]:
    """CREATE TABLE text of an SQLite database, with up to example_values distinct values per column
    (omnisql), cut to max_chars by the length guard (module docstring)."""
    if style not in STYLES:
        raise SlmsqlError(f"unknown prompt style {style!r}; choose one of {STYLES}")
    examples = example_values if style == "omnisql" else 0
    return _fit_style(_read_db(db_file, examples), examples, max_chars, style)


def read_tables_json(path) -> dict[str, dict]:
    """A Spider/BIRD tables.json: db_id -> its entry (checked by `tables_from_json` when used)."""
    path = Path(path)
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read tables.json: {e}", path, getattr(e, "lineno", None)) from None
    if not isinstance(entries, list):
        raise DataError("expected a JSON list of databases", path)
    return {e["db_id"]: e for e in entries if isinstance(e, dict) and "db_id" in e}


def tables_from_json(entry: dict, source=None) -> list[dict]:
    """A tables.json entry as [{name, columns: [(name, type, [])], pk: [names], fks: [(column, table, column)]}],
    in the entry's order; a malformed entry raises DataError naming `source`."""
    db = entry.get("db_id") if isinstance(entry, dict) else None
    for key in ("table_names_original", "column_names_original", "column_types", "primary_keys", "foreign_keys"):
        if not isinstance(entry, dict) or not isinstance(entry.get(key), list):
            raise DataError(f"tables.json entry for {db!r}: missing or not a list", source, field=key)
    names = entry["table_names_original"]
    cols = entry["column_names_original"]
    tables = [{"name": n, "columns": [], "pk": [], "fks": []} for n in names]
    try:
        for (ti, col), typ in zip(cols, entry["column_types"]):
            if ti >= 0:
                tables[ti]["columns"].append((col, typ, []))
        for pk in entry["primary_keys"]:  # an int, or a list of ints for a composite key
            for ci in pk if isinstance(pk, list) else [pk]:
                tables[cols[ci][0]]["pk"].append(cols[ci][1])
        for ci, ref in entry["foreign_keys"]:
            tables[cols[ci][0]]["fks"].append((cols[ci][1], names[cols[ref][0]], cols[ref][1]))
    except (IndexError, TypeError, ValueError) as e:
        raise DataError(f"tables.json entry for {db!r} is malformed: {e!r}", source) from None
    return tables


def schema_from_tables_json(entry: dict) -> str:
    """The same CREATE TABLE text from a Spider/BIRD tables.json entry (no example values there)."""
    return "\n".join(_render(tables_from_json(entry), 0))


def build_messages(question: str, schema: str, evidence: str | None = None, system: bool = True) -> list[dict]:
    parts = [f"Database schema:\n{schema}"]
    if evidence:
        parts.append(f"Evidence: {evidence}")
    parts += [f"Question: {question}", INSTRUCTION]
    # What the model reads is text a tokenizer can encode: a lone surrogate (a JSON "\ud800" escape in a
    # gold file) becomes U+FFFD here; the data files keep the exact string.
    user = {"role": "user", "content": safe_text("\n\n".join(parts))}
    return [{"role": "system", "content": SYSTEM}, user] if system else [user]


def answer(sql: str) -> str:
    """The assistant turn SFT trains on and the format reward looks for (encodable text, as above)."""
    return safe_text(f"```sql\n{sql}\n```")


def render_prompt(tokenizer, messages: list[dict]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise SlmsqlError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class PromptBuilder:
    """Messages for gold examples; one schema per db_id, read once, from tables.json (when given and it lists
    the database) or else from the .sqlite file."""

    def __init__(self, db_root, tables_json=None, example_values: int = 3, max_chars: int | None = MAX_CHARS,
                 style: str = "omnisql", answer_prefix: str = ""):
        if style not in STYLES:
            raise SlmsqlError(f"unknown prompt style {style!r}; choose one of {STYLES}")
        self.db_root, self.tables_json, self.style = Path(db_root), tables_json, style
        self.answer_prefix = answer_prefix
        self.example_values, self.max_chars = example_values, max_chars
        self.info: dict[str, dict] = {}  # db_id -> what the length guard dropped
        self._schemas: dict[str, str] = {}
        self._entries: dict[str, dict] | None = None

    def _entry(self, db_id: str) -> dict | None:
        if self.tables_json is None:
            return None
        if self._entries is None:
            self._entries = read_tables_json(self.tables_json)
        return self._entries.get(db_id)

    def _keep(self, key: str, text: str, info: dict) -> str:
        if info["truncated_schema"]:
            log.warning("schema of %s is longer than %d characters: the prompt keeps only its first tables "
                        "(%d characters)", key, self.max_chars, info["chars"])
        self._schemas[key], self.info[key] = text, info
        return text

    def schema(self, db_id: str) -> str:
        if db_id not in self._schemas:
            path = db_path(self.db_root, db_id)
            # tables.json first, when given: it is how Spider/BIRD prompts are usually built (original names, no
            # example values), and the databases the answers run on are under db_root either way
            if (entry := self._entry(db_id)) is not None:
                text, info = _fit_style(tables_from_json(entry, self.tables_json), 0, self.max_chars, self.style)
                info["source"] = "tables.json"
            elif path.is_file():
                text, info = schema_text(path, self.example_values, self.max_chars, self.style)
            else:
                where = f" and not in {self.tables_json}" if self.tables_json else ""
                raise DataError(f"unknown db_id {db_id!r}: no database at {path}{where}", field="db_id")
            self._keep(db_id, text, info)
        return self._schemas[db_id]

    def schema_of_file(self, path) -> str:
        """The schema text of one SQLite file, rendered exactly as `schema(db_id)` renders that database (a
        served model is given a database path, not a db_id under a root)."""
        key = str(Path(path).resolve())
        if key not in self._schemas:
            self._keep(key, *schema_text(path, self.example_values, self.max_chars, self.style))
        return self._schemas[key]

    def messages(self, example) -> list[dict]:
        """Chat messages for an Example (or a dict with db_id, question and optional evidence)."""
        get = example.get if isinstance(example, dict) else lambda k: getattr(example, k, None)
        return self.chat(get("question"), self.schema(get("db_id")), get("evidence"))

    def prompt(self, tokenizer, example) -> str:
        """The text the model continues for an example: its chat messages rendered, then the answer's start."""
        return render_prompt(tokenizer, self.messages(example)) + self.answer_prefix

    def chat(self, question: str, schema: str, evidence: str | None = None) -> list[dict]:
        """Chat messages for a question on a given schema text, in this builder's style."""
        return build_messages(question, schema, evidence, system=self.style == "omnisql")


def answer_prefix(cfg) -> str:
    """The start of the answer a stage gives the model in its prompt (evaluate's `answer_prefix`; '' elsewhere):
    the model continues it, and the completion scored is that start plus what it generated."""
    return getattr(cfg, "answer_prefix", "")


def builder_for(cfg, db_root=None) -> PromptBuilder:
    """The prompt builder a stage config asks for (`prompt_style`, `example_values`, `tables_json`,
    `answer_prefix`)."""
    return PromptBuilder(db_root or cfg.db_root, tables_json=getattr(cfg, "tables_json", "") or None,
                         example_values=cfg.example_values, style=cfg.prompt_style, answer_prefix=answer_prefix(cfg))

