"""A database's schema as a suite fills it: tables.json's tables and columns, keys, and the order to fill them in.

From one Spider tables.json entry (`inputs.prompts.tables_from_json` reads it: original names, Spider's column
types text/number/time/boolean/others, primary keys, foreign keys). Names are matched case-insensitively, as SQLite
matches them; the DDL keeps the original spelling and declares Spider's type names, so a column has the affinity
SQLite gives that name (`number`, `time`, `boolean`, `others`: NUMERIC; `text`: TEXT).

Fill order: parents before children, so that a child's foreign-key column samples keys its parent really holds and
joins find rows. A foreign key that closes a cycle (a self-reference included) cannot wait for its parent: it is
`deferred`, filled once every table has its rows (fill.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from slmsql.inputs.prompts import tables_from_json


@dataclass(frozen=True)
class Column:
    table: str  # original spelling
    name: str
    type: str  # Spider's: text, number, time, boolean, others

    @property
    def key(self) -> tuple[str, str]:
        return self.table.lower(), self.name.lower()


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    pk: tuple[str, ...]  # lower-case column names
    fks: tuple[tuple[str, str, str], ...]  # (column, parent table, parent column), lower case


class Schema:
    def __init__(self, entry: dict, source=None):
        self.db_id = entry.get("db_id")
        self.tables: list[Table] = []
        for t in tables_from_json(entry, source):
            if t["name"].lower().startswith("sqlite_"):  # SQLite's own (world_1 lists sqlite_sequence): reserved
                continue
            cols = tuple(Column(t["name"], c, typ) for c, typ, _ in t["columns"])
            self.tables.append(Table(t["name"], cols, tuple(dict.fromkeys(p.lower() for p in t["pk"])),
                                     tuple((c.lower(), p.lower(), pc.lower()) for c, p, pc in t["fks"])))
        self.by_name = {t.name.lower(): t for t in self.tables}
        self.tables = [Table(t.name, t.columns, t.pk, tuple(fk for fk in t.fks if fk[1] in self.by_name))
                       for t in self.tables]
        self.by_name = {t.name.lower(): t for t in self.tables}
        self.columns = {c.key: c for t in self.tables for c in t.columns}
        self.order, self.deferred = self._order()

    def table_columns(self) -> dict[str, list[str]]:
        """table -> column names: what suites.neighbours swaps a column for."""
        return {t.name.lower(): [c.name for c in t.columns] for t in self.tables}

    def _order(self) -> tuple[list[Table], set[tuple[str, str]]]:
        """Tables parents first (depth-first, in the entry's order: deterministic); the (table, column) foreign
        keys whose parent is not yet filled when their table is (a cycle or a self-reference)."""
        done, visiting, order, deferred = set(), set(), [], set()

        def visit(t: Table):
            visiting.add(t.name.lower())
            for col, parent, _ in t.fks:
                if parent in done or parent not in self.by_name:
                    continue
                if parent in visiting:  # closes a cycle: this column is filled after every table
                    deferred.add((t.name.lower(), col))
                else:
                    visit(self.by_name[parent])
            visiting.discard(t.name.lower())
            done.add(t.name.lower())
            order.append(t)

        for t in self.tables:
            if t.name.lower() not in done:
                visit(t)
        return order, deferred

    def fk_classes(self) -> dict[tuple[str, str], tuple[str, str]]:
        """(table, column) -> a representative of its foreign-key class: columns joined by foreign keys (a child
        and the parent column it references, transitively) share one pool of gold literals, so a literal on
        either side reaches both (a child's value must be a parent's key for the row to join)."""
        parent: dict = {}

        def find(k):
            while parent.get(k, k) != k:
                k = parent[k]
            return k

        for t in self.tables:
            for col, ptable, pcol in t.fks:
                a, b = find((t.name.lower(), col)), find((ptable, pcol))
                if a != b:
                    parent[max(a, b)] = min(a, b)  # the smaller key represents: independent of edge order
        return {k: find(k) for k in self.columns}

    def ddl(self) -> list[str]:
        """CREATE TABLE statements: original names and Spider's types, primary and foreign keys declared."""
        out = []
        for t in self.tables:
            parts = [f"{_q(c.name)} {c.type}" for c in t.columns]
            names = {c.name.lower(): c.name for c in t.columns}
            if t.pk:
                parts.append(f"PRIMARY KEY ({', '.join(_q(names[p]) for p in t.pk)})")
            for col, ptable, pcol in t.fks:
                p = self.by_name[ptable]
                pname = next(c.name for c in p.columns if c.name.lower() == pcol)
                parts.append(f"FOREIGN KEY ({_q(names[col])}) REFERENCES {_q(p.name)} ({_q(pname)})")
            out.append(f"CREATE TABLE {_q(t.name)} (\n  " + ",\n  ".join(parts) + "\n)")
        return out


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'
