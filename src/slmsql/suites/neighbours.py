"""Neighbours of a gold query: near-miss queries a test suite must tell apart from it.

After Zhong, Yu and Klein (EMNLP 2020, "Semantic Evaluation for Text-to-SQL with Distilled Test Suites", sec. 3):
each neighbour is the gold with one small change, so most of them mean something else while looking alike. A
database that gives the gold and a neighbour different results "tells them apart"; distillation keeps databases
that tell apart neighbours no kept database does yet. Written from the paper's description with sqlglot.

Changes, each applied at one place of the parsed gold at a time (`KINDS`):
- drop:       drop a span: one conjunct of an AND/OR, a WHERE, HAVING, ORDER BY, LIMIT, DISTINCT, GROUP BY,
              or one column of a select list of several;
- distinct:   add DISTINCT to a select without it that can return several rows (the inverse of dropping it; not in the paper's list): without
              it no kept database need hold a gold's duplicate rows, and a prediction that loses them (an IN
              subquery for a join) is called right where the real database calls it wrong;
- aggregate:  COUNT, SUM, AVG, MIN, MAX for one another;
- comparison: =, !=, <, <=, >, >= for one another;
- order:      ASC for DESC and back;
- logic:      AND for OR and back;
- like:       LIKE for NOT LIKE and back;
- in:         IN for NOT IN and back;
- column:     a column for another column of its table (needs the schema);
- literal:    a number plus or minus one, a text with its first character changed.
The result is every distinct neighbour SQL that parses and differs from the gold's text, in a fixed order
(walk order, then kind), so a seed downstream is all it takes to make a suite deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlglot
from sqlglot import exp

AGGREGATES = (exp.Count, exp.Sum, exp.Avg, exp.Min, exp.Max)
COMPARISONS = (exp.EQ, exp.NEQ, exp.LT, exp.LTE, exp.GT, exp.GTE)
KINDS = ("drop", "distinct", "aggregate", "comparison", "order", "logic", "like", "in", "column", "literal")


@dataclass(frozen=True)
class Neighbour:
    kind: str
    sql: str


def _sql(tree) -> str:
    return tree.sql(dialect="sqlite")


def _swaps(node, schema, tables):
    """(kind, replacement-maker) for each change at `node`; a maker takes the copy's node and mutates it."""
    if isinstance(node, AGGREGATES) and not isinstance(node.this, exp.Star):  # COUNT(*) has no SUM(*)
        for other in AGGREGATES:
            if other is not type(node):
                yield "aggregate", lambda n, o=other: n.replace(o(this=n.this.copy()))
    if isinstance(node, COMPARISONS):
        for other in COMPARISONS:
            if other is not type(node):
                yield "comparison", lambda n, o=other: n.replace(o(this=n.this.copy(), expression=n.expression.copy()))
    if isinstance(node, exp.Ordered):
        # SQLite puts NULLs first ascending, last descending: keep its default, or sqlglot writes NULLS FIRST/LAST
        yield "order", lambda n: (n.set("desc", not n.args.get("desc")), n.set("nulls_first", not n.args.get("desc")))
    if isinstance(node, (exp.And, exp.Or)):
        other = exp.Or if isinstance(node, exp.And) else exp.And
        yield "logic", lambda n, o=other: n.replace(o(this=n.this.copy(), expression=n.expression.copy()))
        for side in ("this", "expression"):  # drop one conjunct: keep the other side
            keep = "expression" if side == "this" else "this"
            yield "drop", lambda n, k=keep: n.replace(n.args[k].copy())
    for kind, cls in (("like", exp.Like), ("in", exp.In)):
        if isinstance(node, cls) and not isinstance(node.parent, exp.Not):
            yield kind, lambda n: n.replace(exp.Not(this=n.copy()))
        if isinstance(node, exp.Not) and isinstance(node.this, cls):
            yield kind, lambda n: n.replace(n.this.copy())
    if isinstance(node, (exp.Where, exp.Having, exp.Order, exp.Limit, exp.Group, exp.Distinct)):
        yield "drop", lambda n: n.pop()
    if isinstance(node, exp.Select) and not node.args.get("distinct") and not _one_row(node):
        yield "distinct", lambda n: n.set("distinct", exp.Distinct())
    if isinstance(node, exp.Select) and len(node.expressions) > 1:
        for i in range(len(node.expressions)):
            yield "drop", lambda n, i=i: n.expressions[i].pop()
    if isinstance(node, exp.Column) and schema:
        table = tables.get(node.table.lower()) if node.table else (next(iter(tables.values())) if len(
            set(tables.values())) == 1 else None)
        for other in (schema.get(table) or ()) if table else ():
            if other.lower() != node.name.lower():
                yield "column", lambda n, c=other: n.set("this", exp.to_identifier(c))
    if isinstance(node, exp.Literal):
        if node.is_number:
            value = node.this
            try:
                num = int(value)
                bumped = [str(num + 1), str(num - 1)]
            except ValueError:
                num = float(value)
                bumped = [repr(num + 1), repr(num - 1)]
            for b in bumped:
                yield "literal", lambda n, b=b: n.replace(exp.Literal.number(b))
        elif node.this:
            text = node.this
            changed = ("b" if text[0] == "a" else "a") + text[1:] if text[0] not in "%_" else text[0] + "x" + text[1:]
            yield "literal", lambda n, t=changed: n.replace(exp.Literal.string(t))


def _one_row(select) -> bool:
    """DISTINCT cannot change an aggregate without GROUP BY (one row), nor an operand of UNION, INTERSECT or EXCEPT
    (the set operation drops duplicates itself; UNION ALL keeps them)."""
    if isinstance(select.parent, exp.SetOperation) and select.parent.args.get("distinct", True):
        return True
    return not select.args.get("group") and all(
        isinstance(e.unalias(), exp.AggFunc) for e in select.expressions)


def _tables(tree) -> dict[str, str]:
    """Alias or name (lower case) -> table name (lower case), for every table the query reads."""
    out = {}
    for t in tree.find_all(exp.Table):
        out[t.name.lower()] = t.name.lower()
        if t.alias:
            out[t.alias.lower()] = t.name.lower()
    return out


def neighbours(gold_sql: str, schema: dict[str, list[str]] | None = None) -> list[Neighbour]:
    """The neighbours of `gold_sql` (see module docstring). `schema`: table -> column names (lower-case table
    names), for column swaps; without it there are none. A gold sqlglot cannot parse has no neighbours."""
    try:
        tree = sqlglot.parse_one(gold_sql, read="sqlite")
    except sqlglot.errors.ParseError:
        return []
    schema = {k.lower(): v for k, v in (schema or {}).items()}
    tables = _tables(tree)
    gold_text = _sql(tree)
    seen, out = {gold_text}, []
    for i, node in enumerate(tree.walk()):
        for kind, change in _swaps(node, schema, tables):
            copy = tree.copy()
            target = list(copy.walk())[i]
            try:
                change(target)
                text = _sql(copy)
                sqlglot.parse_one(text, read="sqlite")
            except (sqlglot.errors.SqlglotError, ValueError, AttributeError, TypeError):
                continue
            if text not in seen:
                seen.add(text)
                out.append(Neighbour(kind, text))
    return out
