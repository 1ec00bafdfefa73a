"""Does a predicted result equal the gold result? Two published semantics, never mixed.

bird   (default; BIRD, OmniSQL, Arctic-Text2SQL-R1 and the seed experiment): set(pred) == set(gold).
       Row order and duplicate rows are ignored; column order matters.
spider (test-suite, `exec_eval.py`): multiset equality, columns may be permuted, row order matters only
       when the gold SQL contains ORDER BY. DISTINCT is kept as written (test-suite's --keep_distinct).

Values, for both modes: floats are rounded to 9 significant digits so 0.1+0.2 equals 0.3; integers and
floats compare numerically (1 == 1.0, as in SQLite and Python); text never equals a number ('1' != 1);
NULL equals NULL (None == None). Empty results are equal to each other, as in both peers.
"""

from __future__ import annotations

import re
from collections import Counter
from itertools import permutations

MODES = ("bird", "spider")
_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)
_MAX_PERMUTED_COLUMNS = 6  # 720 permutations; wider results fall back to column-multiset signatures


def _norm(value):
    if isinstance(value, float):
        if value != value:  # NaN: SQLite returns NULL instead, but be total anyway
            return ("nan",)
        return float(f"{value:.9g}")
    if isinstance(value, bool):
        return int(value)
    return value


def normalize(rows) -> list[tuple]:
    return [tuple(_norm(v) for v in row) for row in rows]


def _spider_match(pred: list[tuple], gold: list[tuple], ordered: bool) -> bool:
    if len(pred) != len(gold):
        return False
    if not gold:
        return True
    width = len(gold[0])
    if len(pred[0]) != width:
        return False
    # Candidate column mappings: a pred column may stand for a gold column only if their value multisets agree.
    col_bag = lambda rows, j: Counter(r[j] for r in rows)  # noqa: E731
    gold_bags = [col_bag(gold, j) for j in range(width)]
    pred_bags = [col_bag(pred, j) for j in range(width)]
    options = [[i for i in range(width) if pred_bags[i] == gold_bags[j]] for j in range(width)]
    if any(not o for o in options):
        return False
    target = gold if ordered else Counter(gold)
    checked = 0
    for perm in permutations(range(width)):
        if any(perm[j] not in options[j] for j in range(width)):
            continue
        checked += 1
        mapped = [tuple(r[i] for i in perm) for r in pred]
        if (mapped if ordered else Counter(mapped)) == target:
            return True
        if width > _MAX_PERMUTED_COLUMNS and checked > 1000:
            break
    return False


def results_match(pred_rows, gold_rows, mode: str = "bird", gold_sql: str = "") -> bool:
    """True when the prediction's rows count as the gold's under `mode` (see module docstring)."""
    if mode not in MODES:
        raise ValueError(f"unknown match mode {mode!r}; expected one of {MODES}")
    pred, gold = normalize(pred_rows), normalize(gold_rows)
    if mode == "bird":
        return set(pred) == set(gold)
    return _spider_match(pred, gold, ordered=bool(_ORDER_BY.search(gold_sql)))
