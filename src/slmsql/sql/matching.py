"""Does a predicted result equal the gold result? Two published semantics, never mixed.

bird   (default; BIRD, OmniSQL, Arctic-Text2SQL-R1 and the seed experiment): set(pred) == set(gold).
       Row order and duplicate rows are ignored; column order matters.
spider (test-suite, `exec_eval.py`): multiset equality, columns may be permuted, row order matters only
       when the gold SQL contains ORDER BY. DISTINCT is kept as written (test-suite's --keep_distinct).

Values, for both modes: floats are rounded to 9 significant digits so 0.1+0.2 equals 0.3; integers and
floats compare numerically (1 == 1.0, as in SQLite and Python); text never equals a number ('1' != 1);
NULL equals NULL (None == None). Empty results are equal to each other, as in both peers.

Results too big to hold as values (the sandbox's `Whole` reads, past `row_cap` rows) arrive as `Digests`: each
value an 8-byte blake2b digest of a canonical encoding of its normalised value (1 and 1.0 encode alike, '1' and
1 do not), so both modes, column permutations included, apply to them unchanged. A false match would need two
different values of one column to share a 64-bit digest.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
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


# ------------------------------------------------------------------------------------------------ digests
DIGEST_SIZE = 8  # bytes per value


def _encode(value) -> bytes:
    """Bytes equal exactly when the normalised values are equal (Python's ==, as `normalize` compares them)."""
    v = _norm(value)
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # 1.0 == 1 (and 1e20 == 10**20: is_integer floats are exact integers)
    if v is None:
        return b"n"
    if isinstance(v, int):
        return b"i%d" % v
    if isinstance(v, float):
        return b"f" + repr(v).encode()  # repr round-trips: equal floats, equal text
    if isinstance(v, str):
        return b"s" + v.encode("utf-8", "surrogatepass")
    if isinstance(v, bytes):
        return b"b" + v
    return b"r" + repr(v).encode()  # NaN's ("nan",); SQLite returns nothing else


value_key = _encode  # one value's identity as the matching rules see it (the cell rewards' sets of values)


def digest_row(row) -> bytes:
    return b"".join([hashlib.blake2b(_encode(v), digest_size=DIGEST_SIZE).digest() for v in row])


@dataclass(frozen=True)
class Digests:
    """A result as value digests: `n` rows of `width` values, row-major, DIGEST_SIZE bytes each."""
    n: int
    width: int
    data: bytes

    def __len__(self) -> int:
        return self.n

    @classmethod
    def of(cls, rows) -> "Digests":
        return cls(len(rows), len(rows[0]) if rows else 0, b"".join(digest_row(r) for r in rows))

    def matrix(self):
        import numpy as np  # here: sandbox workers import this module and never compare

        return np.frombuffer(self.data, dtype="<u8").reshape(self.n, self.width)

    @cached_property
    def distinct(self) -> int:
        return len(_unique_rows(self.matrix()))


def _unique_rows(m):
    import numpy as np

    return np.unique(m, axis=0) if len(m) else m


class _ValueRows:
    """Normalised rows as tuples: what `_spider_match` needs of a result."""

    def __init__(self, rows):
        self.rows, self.n, self.width = rows, len(rows), len(rows[0]) if rows else 0

    def bag(self, j):
        return Counter(r[j] for r in self.rows)

    def permuted(self, perm, ordered: bool):
        mapped = [tuple(r[i] for i in perm) for r in self.rows]
        return mapped if ordered else Counter(mapped)


class _DigestRows:
    """The same for a `Digests`: a row-per-row uint64 matrix; sorted rows are its multiset."""

    def __init__(self, d: Digests):
        self.m, self.n, self.width = d.matrix(), d.n, d.width

    def bag(self, j):
        import numpy as np

        return np.sort(self.m[:, j]).tobytes()

    def permuted(self, perm, ordered: bool):
        import numpy as np

        m = self.m[:, list(perm)]
        return (m if ordered else m[np.lexsort(m.T[::-1])]).tobytes()


def _spider_match(pred, gold, ordered: bool) -> bool:
    if pred.n != gold.n:
        return False
    if not gold.n:
        return True
    width = gold.width
    if pred.width != width:
        return False
    # Candidate column mappings: a pred column may stand for a gold column only if their value multisets agree.
    gold_bags = [gold.bag(j) for j in range(width)]
    pred_bags = [pred.bag(j) for j in range(width)]
    options = [[i for i in range(width) if pred_bags[i] == gold_bags[j]] for j in range(width)]
    if any(not o for o in options):
        return False
    target = gold.permuted(range(width), ordered)
    checked = 0
    for perm in permutations(range(width)):
        if any(perm[j] not in options[j] for j in range(width)):
            continue
        checked += 1
        if pred.permuted(perm, ordered) == target:
            return True
        if width > _MAX_PERMUTED_COLUMNS and checked > 1000:
            break
    return False


def _bird_digests(pred: Digests, gold: Digests) -> bool:
    if not pred.n or not gold.n:
        return pred.n == gold.n
    return pred.width == gold.width and \
        _unique_rows(pred.matrix()).tobytes() == _unique_rows(gold.matrix()).tobytes()


def results_match(pred_rows, gold_rows, mode: str = "bird", gold_sql: str = "") -> bool:
    """True when the prediction's rows count as the gold's under `mode` (see module docstring). Either may be
    `Digests`; the other is then digested too."""
    if mode not in MODES:
        raise ValueError(f"unknown match mode {mode!r}; expected one of {MODES}")
    ordered = mode == "spider" and bool(_ORDER_BY.search(gold_sql))
    if isinstance(pred_rows, Digests) or isinstance(gold_rows, Digests):
        pred, gold = (r if isinstance(r, Digests) else Digests.of(r) for r in (pred_rows, gold_rows))
        if mode == "bird":
            return _bird_digests(pred, gold)
        return _spider_match(_DigestRows(pred), _DigestRows(gold), ordered)
    pred, gold = normalize(pred_rows), normalize(gold_rows)
    if mode == "bird":
        return set(pred) == set(gold)
    return _spider_match(_ValueRows(pred), _ValueRows(gold), ordered)
