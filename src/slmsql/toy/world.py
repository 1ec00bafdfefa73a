"""The embedded toy world: many small SQLite databases and gold questions, offline, same seed -> same bytes.

A shared-lexicon world. Every database belongs to one of nine domains (shop, school, library, ...), but its
table names, column names and categorical values are all drawn from ONE shared lexicon: each table slot picks
a synonym ("customer" / "client" / "buyer") and a subset of candidate columns, and the same words recur across
domains ("client" in shop and hospital, "city" in a dozen tables). A scratch experiment (before this
project, on a toy text-to-SQL world like this one) found that a 0.8M-parameter model reaches 0% on unseen databases
unless their identifiers are words it has already seen as identifiers; with a shared lexicon and identifier renaming
during training it reached 24-47%. We get the renaming by construction rather than by rewriting examples:
training questions are spread over many databases (40 / 120 / 400 by size), so each word appears under many
schemas. (Renaming at training time would also need a renamed copy of each database for the execution
reward, which this avoids.)

Splits: sft, rl_source and dev are disjoint questions over the training databases; dev_cross asks about
databases never seen in training, whose schemas differ from every training schema but whose identifiers all
occur in training databases (new schemas, known words). A (db_id, question) pair and a (db_id, sql) pair
occur at most once across all splits, so dev never holds a paraphrase of a training question. Every gold
query executes and returns a non-empty result; ORDER BY ... LIMIT queries have no ties up to one row past
the limit, so the answer does not depend on how SQLite breaks ties. Difficulty comes from the template:
simple (one table, one condition or aggregate), moderate (two clauses, ranges, dates, GROUP BY, ORDER BY
LIMIT, one join), challenging (HAVING, nested queries, joins with aggregation, three-table joins).

Prompts for the tiny default model stay short: 3-4 tables of 4-6 columns. The word lists and domain
schemas live in `toy/lexicon.py`; this module builds databases and questions from them.
"""

from __future__ import annotations

import datetime
import json
import logging
import random
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from slmsql.errors import SlmsqlError
from slmsql.inputs.data import DIFFICULTIES, Example, write_jsonl
from slmsql.runtime.outputs import Staged
from slmsql.toy.lexicon import (
    ADJ,
    DATES,
    DOMAINS,
    FIRST,
    LAST,
    MATERIAL,
    NO_SUM,
    NOUN,
    NUMERIC,
    OBJECT,
    POOLS,
    an,
    human,
    plural,
)

log = logging.getLogger(__name__)

SPLITS = ("sft", "rl_source", "dev", "dev_cross")
_BASE = {"sft": 2000, "rl_source": 300, "dev": 200, "dev_cross": 200}
# size -> (multiplier of _BASE, training databases, dev_cross databases): ~62 questions per training db
SIZES = {"small": (1, 40, 10), "medium": (3, 120, 30), "large": (10, 400, 100)}
_DIFFICULTY_WEIGHTS = {"simple": 0.4, "moderate": 0.35, "challenging": 0.25}

# ---- databases --------------------------------------------------------------------------------------------
@dataclass
class Table:
    name: str
    pk: str
    label: str | None  # the name/title column; fact tables have none
    columns: list[str]
    kinds: dict[str, str]  # column -> pk | fk | label | cat | int | real | date | email
    gens: dict[str, object] = field(default_factory=dict)
    nullable: tuple[str, ...] = ()
    parents: dict[str, "Table"] = field(default_factory=dict)  # fk column -> parent table

    @property
    def plural(self) -> str:
        return plural(self.name)

    @property
    def shown(self) -> str:  # what "List the ..." selects
        return self.label or self.pk

    def of(self, *kinds: str, nulls: bool = False) -> list[str]:
        return [c for c in self.columns if self.kinds[c] in kinds and (nulls or c not in self.nullable)]

    def signature(self) -> tuple:
        return (self.name, tuple(self.columns))


def _schema(domain: str, rng: random.Random) -> list[Table]:
    tables: list[Table] = []
    for names, label, candidates, parents in DOMAINS[domain]:
        name = rng.choice(names.split())
        pk = f"{name}_id"
        cols, kinds, gens = [pk], {pk: "pk"}, {}
        if label:
            col, gen = label.split(":")
            cols.append(col)
            kinds[col], gens[col] = "label", gen
        fks = {}
        for i in parents:
            parent = tables[i]
            cols.append(parent.pk)
            kinds[parent.pk] = "fk"
            fks[parent.pk] = parent
        words = candidates.split()
        lo = max(2, 4 - len(cols))  # 4-6 columns in all, at least two plain attributes
        chosen = sorted(rng.sample(range(len(words)), rng.randint(lo, min(len(words), 6 - len(cols)))))
        nullable = []
        for w in (words[i] for i in chosen):
            col = w.rstrip("?")
            if w.endswith("?"):
                nullable.append(col)
            cols.append(col)
            if col in POOLS:
                kinds[col], gens[col] = "cat", POOLS[col]
            elif col in NUMERIC:
                kinds[col], gens[col] = NUMERIC[col][0], NUMERIC[col]
            elif col in DATES:
                kinds[col], gens[col] = "date", DATES[col]
            else:
                kinds[col] = col  # email
        tables.append(Table(name, pk, label.split(":")[0] or None, cols, kinds, gens, tuple(nullable), fks))
    return tables


def _value(t: Table, col: str, rng: random.Random, cats: dict):
    kind, gen = t.kinds[col], t.gens.get(col)
    if col in t.nullable and rng.random() < 0.25:
        return None
    if kind == "cat":
        values, weights = cats[col]
        return rng.choices(values, weights)[0]
    if kind == "int":
        return rng.randint(gen[1], gen[2])
    if kind == "real":
        return round(rng.uniform(gen[1], gen[2]), gen[3])
    if kind == "date":
        lo, hi = datetime.date(gen[0], 1, 1).toordinal(), datetime.date(gen[1], 12, 31).toordinal()
        return datetime.date.fromordinal(rng.randint(lo, hi)).isoformat()
    if kind == "email":
        return f"{rng.choice(FIRST)}.{rng.choice(LAST)}{rng.randint(1, 99)}@example.com".lower()
    raise AssertionError(kind)


def _label(gen: str, rng: random.Random) -> str:
    if gen == "person":
        return f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    if gen == "product":
        return f"{rng.choice(MATERIAL)} {rng.choice(OBJECT)}"
    return f"{rng.choice(ADJ)} {rng.choice(NOUN)}"


def _create(t: Table) -> str:
    lines = [f"{c} {_sql_type(t, c)}" + (" PRIMARY KEY" if c == t.pk else "")
             + ("" if c in t.nullable or c == t.pk else " NOT NULL") for c in t.columns]
    lines += [f"FOREIGN KEY ({c}) REFERENCES {p.name} ({p.pk})" for c, p in t.parents.items()]
    return f"CREATE TABLE {t.name} (\n  " + ",\n  ".join(lines) + "\n)"


def _sql_type(t: Table, col: str) -> str:
    kind = t.kinds[col]
    return {"pk": "INTEGER", "fk": "INTEGER", "int": "INTEGER", "real": "REAL", "date": "DATE"}.get(kind, "TEXT")


def _fill(con: sqlite3.Connection, tables: list[Table], rng: random.Random) -> None:
    """Realistic rows; categorical values use a per-db subset with skewed weights so group sizes differ."""
    ids: dict[str, list[int]] = {}
    for t in tables:
        n = rng.randint(30, 70) if t.label is None else rng.randint(12, 30)
        cats = {}
        for c in t.of("cat"):
            values = rng.sample(t.gens[c], min(len(t.gens[c]), rng.randint(3, 6)))
            cats[c] = (values, [rng.uniform(0.3, 1.0) for _ in values])
        fk_weights = {c: [rng.uniform(0.2, 1.0) for _ in ids[p.name]] for c, p in t.parents.items()}
        labels: list[str] = []
        while t.label and len(labels) < n:  # unique labels: "the customer with ..." names one customer
            v = _label(t.gens[t.label], rng)
            if v not in labels:
                labels.append(v)
        rows = []
        for i in range(1, n + 1):
            row = []
            for c in t.columns:
                kind = t.kinds[c]
                if kind == "pk":
                    row.append(i)
                elif kind == "label":
                    row.append(labels[i - 1])
                elif kind == "fk":
                    row.append(rng.choices(ids[t.parents[c].name], fk_weights[c])[0])
                else:
                    row.append(_value(t, c, rng, cats))
            rows.append(row)
        con.execute(_create(t))
        con.executemany(f"INSERT INTO {t.name} VALUES ({', '.join('?' * len(t.columns))})", rows)
        ids[t.name] = list(range(1, n + 1))


# ---- question templates -----------------------------------------------------------------------------------
class _Db:
    def __init__(self, con: sqlite3.Connection, tables: list[Table]):
        self.con, self.tables = con, tables
        self._values: dict = {}

    def q(self, sql: str) -> list[tuple]:
        return self.con.execute(sql).fetchall()

    def values(self, t: Table, c: str) -> list:
        if (t.name, c) not in self._values:
            self._values[t.name, c] = [r[0] for r in self.q(
                f"SELECT DISTINCT {c} FROM {t.name} WHERE {c} IS NOT NULL ORDER BY {c}")]
        return self._values[t.name, c]

    def middle(self, t: Table, c: str, rng: random.Random):
        """A threshold inside the column's range, so filters keep some rows and drop others."""
        vs = self.values(t, c)
        v = vs[rng.randint(len(vs) // 5, max(len(vs) // 5, 4 * len(vs) // 5 - 1))]
        return int(round(v)) if isinstance(v, float) else v

    def pick(self, rng: random.Random, *kinds: str, nulls: bool = False):
        """A random (table, column) of the given kinds; nulls=True: only NULL-able columns."""
        cols = {t.name: [c for c in t.of(*kinds, nulls=nulls) if not nulls or c in t.nullable] for t in self.tables}
        ok = [t for t in self.tables if cols[t.name]]
        if not ok:
            return None, None
        t = rng.choice(ok)
        return t, rng.choice(cols[t.name])

    def edges(self) -> list[tuple[Table, str, Table]]:  # (child, fk column, parent)
        return [(t, c, p) for t in self.tables for c, p in t.parents.items()]


def lit(v) -> str:
    return "'" + v.replace("'", "''") + "'" if isinstance(v, str) else repr(v)


def words(t: Table) -> dict:
    return {"t": t.name, "ts": t.plural, "L": human(t.shown), "Ls": plural(human(t.shown))}


AGGS = {"AVG": ["average", "mean"], "MAX": ["maximum", "highest"], "MIN": ["minimum", "lowest"],
        "SUM": ["total"]}


def _agg(rng, col):
    fn = rng.choice([a for a in AGGS if a != "SUM" or col not in NO_SUM])
    return fn, rng.choice(AGGS[fn])


def t_count_all(db, rng):
    t = rng.choice(db.tables)
    q = rng.choice(["How many {ts} are there?", "Count the {ts}.", "What is the total number of {ts}?"])
    return q.format(**words(t)), f"SELECT COUNT(*) FROM {t.name}"


def t_eq(db, rng):
    t, c = db.pick(rng, "cat")
    if not t:
        return None
    v = rng.choice(db.values(t, c))
    q = rng.choice(["List the {Ls} of {ts} whose {c} is {v}.", "Which {ts} have {c} {v}? Give their {Ls}.",
                    "Show the {L} of every {t} with {c} {v}."])
    return q.format(c=human(c), v=v, **words(t)), f"SELECT {t.shown} FROM {t.name} WHERE {c} = {lit(v)}"


def t_cmp(db, rng):
    t, c = db.pick(rng, "int", "real")
    if not t:
        return None
    x, op = db.middle(t, c, rng), rng.choice([">", "<"])
    more = op == ">"
    q = rng.choice(["List the {Ls} of {ts} with {c} {w} {x}.", "Which {ts} have {c} {w} {x}? Give their {Ls}."])
    w = rng.choice(["above", "greater than", "over"] if more else ["below", "less than", "under"])
    return q.format(c=human(c), w=w, x=x, **words(t)), f"SELECT {t.shown} FROM {t.name} WHERE {c} {op} {x}"


def t_count_eq(db, rng):
    t, c = db.pick(rng, "cat")
    if not t:
        return None
    v = rng.choice(db.values(t, c))
    q = rng.choice(["How many {ts} have {c} {v}?", "Count the {ts} whose {c} is {v}.",
                    "What is the number of {ts} with {c} {v}?"])
    return q.format(c=human(c), v=v, **words(t)), f"SELECT COUNT(*) FROM {t.name} WHERE {c} = {lit(v)}"


def t_agg(db, rng):
    t, c = db.pick(rng, "int", "real")
    if not t:
        return None
    fn, w = _agg(rng, c)
    q = rng.choice(["What is the {w} {c} of {ts}?", "Find the {w} {c} across all {ts}.",
                    "Give the {w} {c} over all {ts}."])
    return q.format(w=w, c=human(c), **words(t)), f"SELECT {fn}({c}) FROM {t.name}"


def t_null(db, rng):
    t, c = db.pick(rng, "int", "real", "date", "email", "cat", nulls=True)
    if not t:
        return None
    if rng.random() < 0.5:
        q = rng.choice(["Which {ts} have no {c}? Give their {Ls}.", "List the {Ls} of {ts} whose {c} is missing.",
                        "Show the {L} of each {t} without a recorded {c}."])
        return q.format(c=human(c), **words(t)), f"SELECT {t.shown} FROM {t.name} WHERE {c} IS NULL"
    q = rng.choice(["List the {Ls} of {ts} that have a recorded {c}.", "Which {ts} have a known {c}? Give their {Ls}."])
    return q.format(c=human(c), **words(t)), f"SELECT {t.shown} FROM {t.name} WHERE {c} IS NOT NULL"


def t_like(db, rng):
    t, c = db.pick(rng, "label")
    if not t:
        return None
    v = rng.choice(db.values(t, c))
    first, last = v.split(" ", 1)
    style = rng.randrange(3)
    if style == 0:
        q, pat = rng.choice(["List the {Ls} of {ts} whose {c} starts with {x}.",
                             "Which {ts} have a {c} beginning with {x}?"]), (first[0], f"{first[0]}%")
    elif style == 1:
        q, pat = rng.choice(["List the {Ls} of {ts} whose {c} ends with {x}.",
                             "Which {ts} have a {c} ending in {x}?"]), (last, f"%{last}")
    else:
        q, pat = rng.choice(["List the {Ls} of {ts} whose {c} contains {x}.",
                             "Which {ts} have {x} in their {c}?"]), (first, f"%{first}%")
    sql = f"SELECT {t.shown} FROM {t.name} WHERE {c} LIKE {lit(pat[1])}"
    return q.format(c=human(c), x=pat[0], **words(t)), sql


def t_distinct(db, rng):
    t, c = db.pick(rng, "cat")
    if not t:
        return None
    q = rng.choice(["List the distinct {cs} of {ts}.", "What are the different {cs} of {ts}?",
                    "Show each {c} that occurs among {ts}, once."])
    return q.format(c=human(c), cs=plural(human(c)), **words(t)), f"SELECT DISTINCT {c} FROM {t.name}"


def t_between(db, rng):
    t, c = db.pick(rng, "int", "real")
    if not t:
        return None
    a, b = sorted([db.middle(t, c, rng), db.middle(t, c, rng)])
    if a == b:
        return None
    q = rng.choice(["List the {Ls} of {ts} with {c} between {a} and {b}.",
                    "Which {ts} have {c} from {a} to {b}? Give their {Ls}."])
    return q.format(c=human(c), a=a, b=b, **words(t)), f"SELECT {t.shown} FROM {t.name} WHERE {c} BETWEEN {a} AND {b}"


def t_date(db, rng):
    t, c = db.pick(rng, "date")
    if not t:
        return None
    if rng.random() < 0.5:
        d, op = db.middle(t, c, rng), rng.choice(["<", ">"])
        w = "before" if op == "<" else "after"
        q = rng.choice(["List the {Ls} of {ts} with a {c} {w} {d}.", "Which {ts} have a {c} {w} {d}? Give their {Ls}."])
        return q.format(c=human(c), w=w, d=d, **words(t)), f"SELECT {t.shown} FROM {t.name} WHERE {c} {op} '{d}'"
    y = db.middle(t, c, rng)[:4]
    q = rng.choice(["List the {Ls} of {ts} with a {c} in {y}.", "Which {ts} have their {c} in the year {y}?"])
    return (q.format(c=human(c), y=y, **words(t)),
            f"SELECT {t.shown} FROM {t.name} WHERE strftime('%Y', {c}) = '{y}'")


def t_and(db, rng):
    t, c = db.pick(rng, "cat")
    nums = t.of("int", "real") if t else []
    if not nums:
        return None
    n = rng.choice(nums)
    v, x, op = rng.choice(db.values(t, c)), db.middle(t, n, rng), rng.choice([">", "<"])
    w = "above" if op == ">" else "below"
    q = rng.choice(["List the {Ls} of {ts} whose {c} is {v} and whose {n} is {w} {x}.",
                    "Which {ts} with {c} {v} have a {n} {w} {x}? Give their {Ls}."])
    sql = f"SELECT {t.shown} FROM {t.name} WHERE {c} = {lit(v)} AND {n} {op} {x}"
    return q.format(c=human(c), v=v, n=human(n), w=w, x=x, **words(t)), sql


def _no_ties(db, key_sql: str, k: int) -> bool:
    keys = [r[0] for r in db.q(key_sql + f" LIMIT {k + 1}")]
    return len(keys) >= k and len(set(keys)) == len(keys)


def t_topk(db, rng):
    t, c = db.pick(rng, "int", "real", "date")
    if not t:
        return None
    k, desc = rng.choice([1, 1, 2, 3, 5]), rng.random() < 0.5
    order = "DESC" if desc else "ASC"
    if not _no_ties(db, f"SELECT {c} FROM {t.name} ORDER BY {c} {order}", k):
        return None
    w = rng.choice(["highest", "largest"] if desc else ["lowest", "smallest"])
    if t.kinds[c] == "date":
        w = "latest" if desc else "earliest"
    if k == 1:
        q = rng.choice(["Which {t} has the {w} {c}? Give its {L}.", "Give the {L} of the {t} with the {w} {c}."])
    else:
        q = rng.choice(["List the {Ls} of the {k} {ts} with the {w} {c}.",
                        "Which {k} {ts} have the {w} {c}? Give their {Ls}."])
    sql = f"SELECT {t.shown} FROM {t.name} ORDER BY {c} {order} LIMIT {k}"
    return q.format(w=w, c=human(c), k=k, **words(t)), sql


def t_group_count(db, rng):
    t, c = db.pick(rng, "cat")
    if not t:
        return None
    q = rng.choice(["For each {c}, how many {ts} are there?", "Count the {ts} in each {c}.",
                    "Show every {c} with the number of {ts} that have it."])
    return q.format(c=human(c), **words(t)), f"SELECT {c}, COUNT(*) FROM {t.name} GROUP BY {c}"


def t_agg_where(db, rng):
    t, c = db.pick(rng, "cat")
    nums = t.of("int", "real") if t else []
    if not nums:
        return None
    n, v = rng.choice(nums), rng.choice(db.values(t, c))
    fn, w = _agg(rng, n)
    if rng.random() < 0.5:
        q = rng.choice(["What is the {w} {n} of {ts} whose {c} is {v}?", "Find the {w} {n} among {ts} with {c} {v}."])
        sql = f"SELECT {fn}({n}) FROM {t.name} WHERE {c} = {lit(v)}"
        return q.format(w=w, n=human(n), c=human(c), v=v, **words(t)), sql
    q = rng.choice(["What is the {w} {n} of {ts} for each {c}?", "For every {c}, give the {w} {n} of {ts}."])
    return q.format(w=w, n=human(n), c=human(c), **words(t)), f"SELECT {c}, {fn}({n}) FROM {t.name} GROUP BY {c}"


def _join(child: Table, fk: str, parent: Table) -> str:
    return f"FROM {child.name} JOIN {parent.name} ON {child.name}.{fk} = {parent.name}.{parent.pk}"


def _parent_filter(db, rng, parent: Table):
    """A condition on the parent: its label or a categorical column. -> (phrase, SQL condition) or None."""
    cats = parent.of("cat")
    if parent.label and (not cats or rng.random() < 0.4):
        v = rng.choice(db.values(parent, parent.label))
        return f"{parent.label} is {v}", f"{parent.name}.{parent.label} = {lit(v)}"
    if not cats:
        return None
    c = rng.choice(cats)
    v = rng.choice(db.values(parent, c))
    return f"{human(c)} is {v}", f"{parent.name}.{c} = {lit(v)}"


def t_join_filter(db, rng):
    child, fk, parent = rng.choice(db.edges())
    cond = _parent_filter(db, rng, parent)
    if not cond:
        return None
    q = rng.choice(["List the {Ls} of {ts} whose {p} {cond}.",
                    "Which {ts} belong to {ap} whose {cond}? Give their {Ls}."])
    sql = f"SELECT {child.name}.{child.shown} {_join(child, fk, parent)} WHERE {cond[1]}"
    return q.format(p=parent.name, ap=an(parent.name), cond=cond[0], **words(child)), sql


def t_having(db, rng):
    t, c = db.pick(rng, "cat")
    if not t:
        return None
    counts = sorted({r[0] for r in db.q(f"SELECT COUNT(*) FROM {t.name} GROUP BY {c}")})
    if len(counts) < 2:
        return None
    n = rng.choice(counts[:-1])
    q = rng.choice(["Which {cs} are shared by more than {n} {ts}?", "List each {c} that has more than {n} {ts}."])
    sql = f"SELECT {c} FROM {t.name} GROUP BY {c} HAVING COUNT(*) > {n}"
    return q.format(c=human(c), cs=plural(human(c)), n=n, **words(t)), sql


def t_vs_avg(db, rng):
    t, c = db.pick(rng, "int", "real")
    if not t:
        return None
    op = rng.choice([">", "<"])
    w = "above" if op == ">" else "below"
    q = rng.choice(["List the {Ls} of {ts} whose {c} is {w} the average {c}.",
                    "Which {ts} have {c} {w} the average of all {ts}? Give their {Ls}."])
    sql = f"SELECT {t.shown} FROM {t.name} WHERE {c} {op} (SELECT AVG({c}) FROM {t.name})"
    return q.format(c=human(c), w=w, **words(t)), sql


def t_in_sub(db, rng):
    child, fk, parent = rng.choice(db.edges())
    if rng.random() < 0.3:
        q = rng.choice(["List the {Ls} of {ts} that have no {cs}.", "Which {ts} have no {cs} at all? Give their {Ls}."])
        sql = f"SELECT {parent.shown} FROM {parent.name} WHERE {parent.pk} NOT IN (SELECT {fk} FROM {child.name})"
        return q.format(cs=child.plural, **words(parent)), sql
    cats = child.of("cat")
    if not cats:
        return None
    c = rng.choice(cats)
    v = rng.choice(db.values(child, c))
    q = rng.choice(["List the {Ls} of {ts} that have {ch} whose {c} is {v}.",
                    "Which {ts} have at least one {chs} with {c} {v}? Give their {Ls}."])
    sql = (f"SELECT {parent.shown} FROM {parent.name} WHERE {parent.pk} IN "
           f"(SELECT {fk} FROM {child.name} WHERE {c} = {lit(v)})")
    return q.format(ch=an(child.name), chs=child.name, c=human(c), v=v, **words(parent)), sql


def t_join_group(db, rng):
    child, fk, parent = rng.choice(db.edges())
    shown, j = f"{parent.name}.{parent.shown}", _join(child, fk, parent)
    if rng.random() < 0.5:
        q = rng.choice(["For each {t}, give its {L} and the number of {cs}.",
                        "How many {cs} does each {t} have? Show the {L} and the count."])
        sql = f"SELECT {shown}, COUNT(*) {j} GROUP BY {parent.name}.{parent.pk}"
        return q.format(cs=child.plural, **words(parent)), sql
    nums = child.of("int", "real")
    if rng.random() < 0.5 or not nums:
        if not _no_ties(db, f"SELECT COUNT(*) {j} GROUP BY {parent.name}.{parent.pk} ORDER BY COUNT(*) DESC", 1):
            return None
        q = rng.choice(["Which {t} has the most {cs}? Give its {L}.", "Give the {L} of the {t} with the most {cs}."])
        sql = f"SELECT {shown} {j} GROUP BY {parent.name}.{parent.pk} ORDER BY COUNT(*) DESC LIMIT 1"
        return q.format(cs=child.plural, **words(parent)), sql
    n = rng.choice(nums)
    cond = _parent_filter(db, rng, parent)
    if not cond or n in NO_SUM:
        return None
    q = rng.choice(["What is the total {n} of {cs} whose {p} {cond}?", "Sum the {n} of {cs} for the {p} whose {cond}."])
    sql = f"SELECT SUM({child.name}.{n}) {j} WHERE {cond[1]}"
    return q.format(n=human(n), cs=child.plural, p=parent.name, cond=cond[0]), sql


def t_join3(db, rng):
    facts = [t for t in db.tables if len(t.parents) == 2]
    if not facts:
        return None
    f = rng.choice(facts)
    (fk1, p1), (fk2, p2) = rng.sample(list(f.parents.items()), 2)
    cond = _parent_filter(db, rng, p2)
    if not cond:
        return None
    q = rng.choice(["List the {Ls} of {ts} with {f} involving {p} whose {cond}.",
                    "Which {ts} have {f} linked to {p} whose {cond}? Give their {Ls}."])
    sql = (f"SELECT DISTINCT {p1.name}.{p1.shown} FROM {f.name} JOIN {p1.name} ON {f.name}.{fk1} = {p1.name}.{p1.pk} "
           f"JOIN {p2.name} ON {f.name}.{fk2} = {p2.name}.{p2.pk} WHERE {cond[1]}")
    return q.format(f=an(f.name), p=an(p2.name), cond=cond[0], **words(p1)), sql


TEMPLATES = {
    "simple": [t_count_all, t_eq, t_cmp, t_count_eq, t_agg, t_null, t_like, t_distinct],
    "moderate": [t_between, t_date, t_and, t_topk, t_group_count, t_agg_where, t_join_filter],
    "challenging": [t_having, t_vs_avg, t_in_sub, t_join_group, t_join3],
}


def _useful(rows: list[tuple]) -> bool:
    """Non-empty and not degenerate: an all-NULL row or a zero count matches too many wrong queries."""
    return bool(rows) and rows != [(0,)] and any(v is not None for r in rows for v in r)


def _questions(db: _Db, n: int, rng: random.Random, db_id: str) -> list[tuple[str, str, str]]:
    out, seen_q, seen_sql = [], set(), set()
    levels, weights = list(_DIFFICULTY_WEIGHTS), list(_DIFFICULTY_WEIGHTS.values())
    for _ in range(n * 50):
        if len(out) == n:
            return out
        level = rng.choices(levels, weights)[0]
        made = rng.choice(TEMPLATES[level])(db, rng)
        if not made or made[0] in seen_q or made[1] in seen_sql or not _useful(db.q(made[1])):
            continue
        seen_q.add(made[0])
        seen_sql.add(made[1])
        out.append((made[0], made[1], level))
    raise SlmsqlError(f"toy world: could only make {len(out)} of {n} questions for {db_id}")


# ---- the world ------------------------------------------------------------------------------------------
def _plan(seed: int, n_train: int, n_cross: int) -> list[tuple[str, list[Table], bool]]:
    """(db_id, tables, is_cross) for every db. Cross schemas are new but use only training identifiers."""
    plan, known_words, known_schemas = [], set(), set()
    domains = list(DOMAINS)
    for i in range(n_train + n_cross):
        cross, domain = i >= n_train, domains[i % len(domains)]
        for attempt in range(1000):
            tables = _schema(domain, random.Random(f"slmsql-toy:{seed}:{i}:{attempt}"))
            sig = tuple(t.signature() for t in tables)
            ids = {w for t in tables for w in (t.name, *t.columns)}
            if not cross or (sig not in known_schemas and ids <= known_words):
                break
        else:
            raise SlmsqlError(f"toy world: no unseen schema with known words for domain {domain}")
        if not cross:
            known_schemas.add(sig)
            known_words |= ids
        plan.append((f"{domain}_{i:03d}", tables, cross))
    return plan


def _spread(total: int, n: int) -> list[int]:
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def _build(out: Path, seed: int, size: str) -> dict:
    mult, n_train, n_cross = SIZES[size]
    counts = {s: c * mult for s, c in _BASE.items()}
    plan = _plan(seed, n_train, n_cross)
    train_n = iter(_spread(counts["sft"] + counts["rl_source"] + counts["dev"], n_train))
    cross_n = iter(_spread(counts["dev_cross"], n_cross))
    pool, cross = [], []
    for db_id, tables, is_cross in plan:
        rng = random.Random(f"slmsql-toy:{seed}:{db_id}:data")
        path = out / "databases" / db_id / f"{db_id}.sqlite"
        path.parent.mkdir(parents=True)
        con = sqlite3.connect(path)
        try:
            with con:  # one transaction: a deterministic file
                _fill(con, tables, rng)
            made = _questions(_Db(con, tables), next(cross_n if is_cross else train_n), rng, db_id)
        finally:
            con.close()
        (cross if is_cross else pool).extend((db_id, *m) for m in made)
    random.Random(f"slmsql-toy:{seed}:split").shuffle(pool)
    splits = {"sft": pool[:counts["sft"]], "rl_source": pool[counts["sft"]:counts["sft"] + counts["rl_source"]],
              "dev": pool[counts["sft"] + counts["rl_source"]:], "dev_cross": cross}
    summary = {"seed": seed, "size": size, "counts": {}, "databases": {}}
    for name, rows in splits.items():
        examples = [Example(f"{name}-{i:05d}", db_id, q, sql, difficulty=level)
                    for i, (db_id, q, sql, level) in enumerate(rows)]
        write_jsonl(out / f"{name}.jsonl", examples)
        summary["counts"][name] = {"total": len(rows), **{d: sum(r[3] == d for r in rows) for d in DIFFICULTIES}}
        summary["databases"][name] = sorted({r[0] for r in rows})
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def generate(output_dir, seed: int, size: str = "small", overwrite: bool = False) -> dict:
    """Write the toy world to output_dir; returns the summary plus the seconds it took.

    Built in `<output_dir>.partial` and renamed into place (outputs.Staged), so a crash leaves nothing
    half-written under the final name.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise SlmsqlError(f"toy world: seed must be an integer, got {seed!r}")
    if size not in SIZES:
        raise SlmsqlError(f"toy world: unknown size {size!r}; choose one of {', '.join(SIZES)}")
    start = time.perf_counter()
    with Staged(output_dir, overwrite) as st:
        summary = _build(st.work, seed, size)
    return {**summary, "seconds": round(time.perf_counter() - start, 2)}
