"""How close a predicted SQL text is to the gold's, without running it: the partial rewards of Reasoning-SQL
(Pourreza et al., 2025) that need no execution and no LLM judge. Pure functions of SQL text (and, for schema
linking, the database's table -> columns map), read with sqlglot's SQLite dialect.

Identifiers compare case-insensitively, as SQLite resolves them; string literals keep their case.
"""

from __future__ import annotations

import functools
import sqlite3
import urllib.parse
from pathlib import Path

DIALECT = "sqlite"


@functools.lru_cache(maxsize=4096)
def parse(sql: str | None):
    """The one query `sql` holds, as a sqlglot expression (shared, cached: copy before changing it), or None when
    it is empty, does not parse, holds more than one statement, or is not a query (SELECT, set operation, WITH)."""
    import sqlglot
    from sqlglot import exp
    from sqlglot.errors import SqlglotError

    if not sql or not sql.strip():
        return None
    try:
        statements = [s for s in sqlglot.parse(sql, read=DIALECT) if s is not None]
    except (SqlglotError, RecursionError, ValueError):
        return None
    return statements[0] if len(statements) == 1 and isinstance(statements[0], exp.Query) else None


def syntax(sql: str | None) -> float:
    """1.0 when `sql` parses as one SQLite query (sqlglot), else 0.0. Reasoning-SQL's syntax-check reward, here
    by parsing alone: whether it also runs is the execution reward's `runs` tier."""
    return 1.0 if parse(sql) is not None else 0.0


def jaccard(a: frozenset, b: frozenset) -> float:
    """|a & b| / |a | b|; two empty sets are identical (1.0)."""
    return len(a & b) / len(a | b) if a or b else 1.0


def schema_items(sql: str | None, schema: dict | None = None) -> frozenset | None:
    """The tables and columns a query reads, as `table:<t>` and `column:<t>.<c>` (lower case), None when it does
    not parse. Aliases resolve to their tables, `*` and `t.*` expand to the table's columns (with `schema`, a
    {table: [columns]} map: unexpanded without), unqualified columns go to the table that has them, columns of a
    subquery or CTE count where they are read from a table (inside it), correlated columns resolve outward.
    A column no table resolves (unknown, ambiguous, or from an unknown alias) counts as `column:?.<c>`."""
    from sqlglot import exp
    from sqlglot.errors import SqlglotError
    from sqlglot.optimizer.qualify import qualify
    from sqlglot.optimizer.scope import traverse_scope

    tree = parse(sql)
    if tree is None:
        return None
    mapping = {t: {c: "text" for c in cols} for t, cols in (schema or {}).items()}
    try:
        tree = qualify(tree.copy(), schema=mapping or None, dialect=DIALECT, validate_qualify_columns=False,
                       expand_stars=bool(mapping), quote_identifiers=False, identify=False)
        scopes = list(traverse_scope(tree))
    except (SqlglotError, RecursionError, KeyError, ValueError):
        return None  # qualify refuses what it cannot resolve at all (e.g. a column alias cycle): no reading
    items = set()
    for scope in scopes:
        for source in scope.sources.values():
            if isinstance(source, exp.Table) and source.name:
                items.add(f"table:{source.name.lower()}")
        for column in scope.columns:
            table = _table_of(scope, column.table) if column.table else None
            if table is not False:  # False: a subquery's or CTE's column, counted inside it
                items.add(f"column:{table or '?'}.{column.name.lower()}")
    return frozenset(items)


def _table_of(scope, alias: str):
    """The table an alias names, seen from `scope` and then its enclosing scopes (correlated subqueries): its name,
    False for a subquery or CTE, None when nothing in reach has that alias."""
    from sqlglot import exp

    while scope is not None:
        source = scope.sources.get(alias)
        if source is not None:
            return source.name.lower() if isinstance(source, exp.Table) else False
        scope = scope.parent
    return None


def schema_linking(pred: str | None, gold: str | None, schema: dict | None = None) -> float:
    """Jaccard similarity of the tables and columns the prediction reads and those the gold reads (`schema_items`):
    Reasoning-SQL's schema-linking reward. 0.0 when either does not parse (an empty prediction included)."""
    p, g = schema_items(pred, schema), schema_items(gold, schema)
    return 0.0 if p is None or g is None else jaccard(p, g)


@functools.lru_cache(maxsize=4096)
def bigrams(sql: str | None) -> frozenset | None:
    """The set of adjacent token pairs of `sql` (sqlglot's SQLite tokenizer; keywords and identifiers lower-cased,
    string literals as written), None when it does not tokenize (an unterminated string) or is empty."""
    from sqlglot.dialects.sqlite import SQLite
    from sqlglot.errors import SqlglotError
    from sqlglot.tokens import TokenType

    if not sql or not sql.strip():
        return None
    try:
        tokens = SQLite().tokenize(sql)
    except (SqlglotError, RecursionError, ValueError):
        return None
    texts = [f"'{t.text}'" if t.token_type == TokenType.STRING else t.text.lower() for t in tokens
             if t.token_type != TokenType.SEMICOLON]
    return frozenset(zip(texts, texts[1:]))


def ngram(pred: str | None, gold: str | None) -> float:
    """Jaccard similarity of the prediction's and the gold's token bigrams (`bigrams`): Reasoning-SQL's n-gram
    similarity reward, with n = 2. 0.0 for an empty or untokenizable prediction. Lexical: it needs no parse."""
    p, g = bigrams(pred), bigrams(gold)
    return 0.0 if p is None or g is None else jaccard(p, g)


@functools.lru_cache(maxsize=256)
def schema_of(db_file: str) -> dict[str, list[str]]:
    """{table: [columns]} of a SQLite database (lower case), read once per file: what `schema_items` resolves
    `*` and unqualified columns against. The file is slmsql's own, opened read-only."""
    path = urllib.parse.quote(str(Path(db_file).resolve()))
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view') "
                                            "AND name NOT LIKE 'sqlite_%'")]
        quoted = {t: '"' + t.replace('"', '""') + '"' for t in tables}
        return {t.lower(): [r[1].lower() for r in con.execute(f"PRAGMA table_info({quoted[t]})")] for t in tables}
    finally:
        con.close()
