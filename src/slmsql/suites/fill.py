"""Filling one candidate database of a suite: rows for every table, written as an SQLite file.

After Zhong, Yu and Klein (EMNLP 2020), written from the paper's description:
- tables are filled parents first (`Schema.order`): a foreign-key column draws from the values its parent's rows
  hold, so joins find rows; a key that closes a cycle is filled once every table has rows;
- a column draws from its pool: the gold literals compared with it (`pools.literal_pools`) and random values of its
  type (by Spider's type and the column's name: ids, years, dates, booleans, reals, integers, text);
- some columns get only one to three distinct values, so duplicates and ties occur (GROUP BY, DISTINCT, ORDER BY
  ... LIMIT and COUNT tell their neighbours apart only then);
- primary keys are unique (a composite key as a tuple);
- table sizes vary by candidate: each draws a bound from `sizes`, each table 1 to that many rows (small databases
  tell LIMIT and aggregates apart; larger ones hold more combinations).

Deterministic: every draw comes from a `random.Random` seeded from (seed, db_id, candidate index) through sha256,
never from `hash()` or global state; the same inputs write the same rows, in the same statements, into a file with
a fixed page size: the same bytes under one SQLite library (`content_digest` hashes the rows themselves, for a
check that does not depend on SQLite's version).
"""

from __future__ import annotations

import hashlib
import random
import sqlite3
from pathlib import Path

from slmsql.suites.schema import Column, Schema

FEW = 0.3          # share of non-key columns drawn from one to three distinct values in a candidate
LITERAL = 0.35     # chance a value of a column with gold literals is one of them
PAGE_SIZE = 4096
_REAL = ("price", "cost", "amount", "salary", "rate", "average", "avg", "score", "gpa", "weight", "height",
         "percent", "ratio", "latitude", "longitude", "budget", "money", "share", "rating", "gnp", "expectancy")
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "be", "da", "fe", "go", "hu", "ja", "po", "ze")


def rng_for(seed: int, db_id: str, index: int) -> random.Random:
    """The random stream of one candidate: from sha256, so it is the same in every process and Python."""
    digest = hashlib.sha256(f"{seed}\0{db_id}\0{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def kind(col: Column) -> str:
    """What random values a column gets: bool, year, date, real, int or text, by type, then by name."""
    name, typ = col.name.lower(), col.type.lower()
    if typ == "boolean" or name.startswith(("is_", "has_")):
        return "bool"
    if "year" in name:
        return "year"
    if typ == "time" or "date" in name:
        return "date"
    if typ == "number":
        return "real" if any(h in name for h in _REAL) else "int"
    return "text"


def random_value(k: str, rng: random.Random):
    if k == "bool":
        return rng.randint(0, 1)
    if k == "year":
        return rng.randint(1990, 2025)
    if k == "date":
        return f"{rng.randint(1990, 2025)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if k == "real":
        return round(rng.uniform(0, 1000), 2)
    if k == "int":
        return rng.randint(0, 100)
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def _domain(col: Column, n: int, rng: random.Random) -> list:
    """The random values one column draws from in this candidate: few (1-3: duplicates and ties) or about one a
    row."""
    size = rng.randint(1, 3) if rng.random() < FEW else max(n, 1)
    return [random_value(kind(col), rng) for _ in range(size)]


def _draw(domain: list, literals: list, rng: random.Random):
    return rng.choice(literals) if literals and rng.random() < LITERAL else rng.choice(domain)


def _unique(col: Column, literals: list, n: int, rng: random.Random) -> list:
    """n distinct values for a one-column primary key: gold literals and random values as any column draws them,
    repeats skipped; when the draws keep repeating, numbered ones (101, 102, ... or 'Key1', 'Key2', ...)."""
    out, seen = [], set()
    for i in range(20 * n):
        if len(out) == n:
            break
        v = _draw([random_value(kind(col), rng)], literals, rng)
        if v not in seen:
            seen.add(v)
            out.append(v)
    extra = 0
    while len(out) < n:
        extra += 1
        v = 100 + extra if kind(col) in ("int", "bool", "year", "real") else f"Key{extra}"
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out


def generate(schema: Schema, pools: dict, sizes: list[int], rng: random.Random) -> dict[str, list[list]]:
    """table (original name) -> rows, each a list of values in column order."""
    bound = rng.choice(sizes)
    data: dict[str, list[list]] = {}
    values: dict[tuple[str, str], list] = {}  # (table, column) -> the values its rows hold: what children draw
    for t in schema.order:
        tname = t.name.lower()
        n = rng.randint(1, bound)
        fks = {col: (p, pc) for col, p, pc in t.fks if (tname, col) not in schema.deferred}
        cols: dict[str, list] = {}
        for c in t.columns:
            lit = pools.get(c.key, [])
            lname = c.name.lower()
            if lname in fks:
                parent = values[fks[lname]]
                cols[lname] = rng.sample(parent, min(n, len(parent))) if t.pk == (lname,) else \
                    [rng.choice(parent) for _ in range(n)]
            elif t.pk == (lname,):
                cols[lname] = _unique(c, lit, n, rng)
            else:
                domain = _domain(c, n, rng)
                cols[lname] = [_draw(domain, lit, rng) for _ in range(n)]
        n = min(len(v) for v in cols.values())  # a key drawn from a smaller parent shortens the table
        rows = [[cols[c.name.lower()][i] for c in t.columns] for i in range(n)]
        if len(t.pk) > 1:  # a composite key: keep the first row of each key tuple
            idx = [[c.name.lower() for c in t.columns].index(p) for p in t.pk]
            seen: set = set()
            rows = [r for r in rows if tuple(r[i] for i in idx) not in seen and not seen.add(tuple(r[i] for i in idx))]
        data[t.name] = rows
        for i, c in enumerate(t.columns):
            values[c.key] = [r[i] for r in rows]
    for tname, col in sorted(schema.deferred):  # keys closing a cycle: every table has rows now
        t = schema.by_name[tname]
        i = [c.name.lower() for c in t.columns].index(col)
        parent = values[next((p, pc) for c, p, pc in t.fks if c == col)]
        for r in data[t.name]:
            r[i] = rng.choice(parent)
    return data


def write(path, schema: Schema, data: dict[str, list[list]]) -> None:
    """A new SQLite file at `path`: the schema's DDL, then the rows, in one transaction."""
    path = Path(path)
    path.unlink(missing_ok=True)
    con = sqlite3.connect(path, isolation_level=None)
    try:
        con.execute(f"PRAGMA page_size = {PAGE_SIZE}")
        con.execute("BEGIN")
        for stmt in schema.ddl():
            con.execute(stmt)
        for t in schema.tables:
            if data.get(t.name):
                marks = ", ".join("?" * len(t.columns))
                con.executemany(f'INSERT INTO "{t.name}" VALUES ({marks})', data[t.name])
        con.execute("COMMIT")
    finally:
        con.close()


def content_digest(path) -> str:
    """sha256 of a database's rows, table by table in name order, each row as SQLite returns it (type and value):
    the same for the same content whatever SQLite version wrote the file."""
    h = hashlib.sha256()
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"):
            h.update(f"table {name}\n".encode())
            for row in con.execute(f'SELECT * FROM "{name}" ORDER BY rowid'):
                h.update((repr([(type(v).__name__, v) for v in row]) + "\n").encode())
    finally:
        con.close()
    return h.hexdigest()


def file_digest(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
