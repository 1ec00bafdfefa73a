"""Pull the SQL out of a raw model completion.

Order of preference, first hit wins:
1. the last fenced ```sql block (closed, or left open at the end of a truncated completion);
2. the last fenced ``` block with no language whose body starts like SQL;
3. the completion itself when, stripped, it starts with SELECT or WITH (models that answer bare SQL).
Anything else is `None` ("no_sql"): prose is a wrong answer, never an exception.
The returned `how` says which rule fired, so evaluation reports can count fallbacks.
"""

from __future__ import annotations

import re

_SQL_BLOCK = re.compile(r"```[ \t]*sql[ \t]*\n(.*?)(?:```|\Z)", re.IGNORECASE | re.DOTALL)
_BARE_BLOCK = re.compile(r"```[ \t]*\n(.*?)```", re.DOTALL)
_STARTS_SQL = re.compile(r"^\s*(select|with)\b", re.IGNORECASE)


def _clean(sql: str) -> str | None:
    sql = sql.strip().rstrip(";").strip()
    return sql or None


def extract_sql(completion: str | None) -> tuple[str | None, str]:
    """Return (sql or None, how) with how in {"sql_block", "bare_block", "bare_sql", "no_sql"}."""
    text = completion or ""
    blocks = _SQL_BLOCK.findall(text)
    if blocks and (sql := _clean(blocks[-1])):
        return sql, "sql_block"
    for body in reversed(_BARE_BLOCK.findall(text)):
        if _STARTS_SQL.match(body) and (sql := _clean(body)):
            return sql, "bare_block"
    if _STARTS_SQL.match(text) and (sql := _clean(text)):
        return sql, "bare_sql"
    return None, "no_sql"


def completion_text(c) -> str:
    """A completion as text: plain strings as they are; conversational ones as their assistant turn(s)."""
    if isinstance(c, list):
        return "".join(m.get("content") or "" for m in c if isinstance(m, dict))
    return c or ""


def has_sql_block(completion: str | None) -> bool:
    """A closed ```sql block with a non-empty body: what the format reward pays for."""
    return any(b.strip() for b in re.findall(r"```[ \t]*sql[ \t]*\n(.*?)```", completion or "",
                                             re.IGNORECASE | re.DOTALL))
