"""The gold queries' literals, each mapped to the column it is compared with: what a generated database must hold
for the golds to find rows, and for a neighbour that moves a literal to find other rows.

After Zhong, Yu and Klein (EMNLP 2020), written from the paper's description: a column's values are drawn from the
literals the gold queries compare it with, beside random values of its type (fill.py). A literal counts when it is
compared with a column: `col = 3`, `3 < col`, `col IN (...)`, `col LIKE '%x%'`, `col BETWEEN a AND b`. A number
brings its neighbours too, `v - 1` and `v + 1` (`neighbours` moves a number by one, and `>` vs `>=` differ only on a
row holding `v` itself); a LIKE pattern brings strings it matches (its wildcards filled). A literal on a column
reaches every column its foreign keys join it with (`Schema.fk_classes`): a child's value is a parent's key.
"""

from __future__ import annotations

import sqlglot
from sqlglot import exp

from slmsql.suites.schema import Schema

COMPARED = (exp.EQ, exp.NEQ, exp.LT, exp.LTE, exp.GT, exp.GTE)


def value_of(node, names: frozenset = frozenset()):
    """A literal's Python value (a negative number is Neg(Literal)); None when `node` is not a literal. A
    double-quoted name that is none of the schema's column `names` is text, as SQLite reads it: Spider's golds
    write `name = "Kyle"`, which sqlglot parses as a column."""
    if isinstance(node, exp.Column) and not node.table and node.this.args.get("quoted") and \
            node.name.lower() not in names:
        return node.name
    neg = isinstance(node, exp.Neg)
    lit = node.this if neg else node
    if not isinstance(lit, exp.Literal):
        return None
    if not lit.is_number:
        return lit.this
    text = ("-" if neg else "") + lit.this
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return None


def like_matches(pattern: str) -> list[str]:
    """Strings `pattern` matches under LIKE: wildcards filled with nothing ('%Hey%' -> 'Hey') and with letters
    ('xHeyx'), so a suite has rows where the pattern's text stands alone and where it is inside other text."""
    bare = pattern.replace("%", "").replace("_", "a")
    padded = pattern.replace("%", "x").replace("_", "b")
    return list(dict.fromkeys([bare, padded]))


def _scope_tables(node, schema: Schema) -> dict[str, str]:
    """alias or table name (lower case) -> table, for the SELECT around `node` and the SELECTs around that one (a
    correlated subquery sees its outer tables); the nearest SELECT's names win."""
    out: dict[str, str] = {}
    select = node.find_ancestor(exp.Select)
    while select is not None:
        sources = [select.args.get("from_") or select.args.get("from"), *(select.args.get("joins") or [])]
        for src in sources:
            for t in (src.find_all(exp.Table) if src is not None else ()):
                if t.find_ancestor(exp.Select) is not select or t.name.lower() not in schema.by_name:
                    continue  # a table of a subquery in FROM belongs to that subquery
                out.setdefault((t.alias or t.name).lower(), t.name.lower())
                out.setdefault(t.name.lower(), t.name.lower())
        select = select.find_ancestor(exp.Select)
    return out


def resolve(column: exp.Column, schema: Schema) -> list[tuple[str, str]]:
    """The schema columns a column reference may mean: by its qualifier, else every table in scope that has a
    column of that name (Spider's golds leave columns unqualified when only one table has them)."""
    name = column.name.lower()
    scope = _scope_tables(column, schema)
    if column.table:
        tables = [scope.get(column.table.lower(), column.table.lower())]
    else:
        tables = list(dict.fromkeys(scope.values()))
    return [(t, name) for t in tables if (t, name) in schema.columns]


def _is_column(node, names) -> bool:
    return isinstance(node, exp.Column) and value_of(node, names) is None


def _pairs(tree, names: frozenset):
    """(column node, [literal values]) for every comparison of a column with literals in `tree`."""
    for node in tree.walk():
        if isinstance(node, COMPARED):
            for col, lit in ((node.this, node.expression), (node.expression, node.this)):
                if _is_column(col, names) and value_of(lit, names) is not None:
                    v = value_of(lit, names)
                    yield col, [v - 1, v, v + 1] if _number(v) else [v]
        elif isinstance(node, exp.In) and _is_column(node.this, names):
            values = [value_of(e, names) for e in node.expressions]
            yield node.this, [x for v in values if v is not None for x in ([v - 1, v, v + 1] if _number(v) else [v])]
        elif isinstance(node, exp.Like) and _is_column(node.this, names) and \
                isinstance(value_of(node.expression, names), str):
            yield node.this, like_matches(value_of(node.expression, names))
        elif isinstance(node, exp.Between) and _is_column(node.this, names):
            lo, hi = value_of(node.args.get("low"), names), value_of(node.args.get("high"), names)
            values = [v for v in (lo, hi) if v is not None]
            if all(_number(v) for v in values) and len(values) == 2:
                values = [lo - 1, lo, lo + 1, (lo + hi) / 2 if isinstance(lo + hi, float) else (lo + hi) // 2,
                          hi - 1, hi, hi + 1]
            yield node.this, values


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def literal_pools(schema: Schema, golds: list[str]) -> dict[tuple[str, str], list]:
    """(table, column) -> the literals of `golds` compared with it or with a column its foreign keys join it with,
    in the order the golds give them (deterministic). Golds sqlglot cannot parse bring none (the stage refuses
    them before this)."""
    classes = schema.fk_classes()
    names = frozenset(col for _, col in schema.columns)
    by_class: dict = {}
    for sql in golds:
        try:
            tree = sqlglot.parse_one(sql, read="sqlite")
        except sqlglot.errors.ParseError:
            continue
        for col, values in _pairs(tree, names):
            for key in resolve(col, schema) if values else ():
                pool = by_class.setdefault(classes[key], [])
                pool += [v for v in values if v not in pool]
    return {key: by_class[cls] for key, cls in classes.items() if cls in by_class}
