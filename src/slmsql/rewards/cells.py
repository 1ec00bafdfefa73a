"""Partial credit for a wrong result, from the results themselves: QATCH's cell precision, cell recall and tuple
cardinality (Papicchio et al., NeurIPS 2023; used as GRPO rewards by Think2SQL, Papicchio et al. 2025). Pure
functions of two results as the sandbox returns them: row tuples, or `matching.Digests` past its row cap.

Cells compare as sets of values, by the answer matching's own value identity (`matching.value_key`: 1 == 1.0,
'1' != 1, floats to 9 significant digits), so a result that matches the gold scores 1.0 on all three. As in
QATCH, two empty results score 1.0 and one empty result against a non-empty one 0.0.
"""

from __future__ import annotations

from slmsql.sql.matching import DIGEST_SIZE, Digests, digest_row, value_key


def _cells(rows, digests: bool) -> set:
    """The distinct values of a result: value keys, or 8-byte digests when either side is held as digests."""
    if isinstance(rows, Digests):
        return {rows.data[i:i + DIGEST_SIZE] for i in range(0, len(rows.data), DIGEST_SIZE)}
    if digests:
        return {digest_row((v,)) for row in rows for v in row}
    return {value_key(v) for row in rows for v in row}


def _overlap(pred, gold) -> tuple[set, set] | float:
    """Both results' cell sets, or the score QATCH gives when either result is empty."""
    if not len(pred) or not len(gold):
        return 1.0 if not len(pred) and not len(gold) else 0.0
    digests = isinstance(pred, Digests) or isinstance(gold, Digests)
    return _cells(pred, digests), _cells(gold, digests)


def _shared_share(pred, gold, of_pred: bool) -> float:
    """The cells both results hold, as a share of the prediction's (precision) or the gold's (recall)."""
    sets = _overlap(pred, gold)
    if isinstance(sets, float):
        return sets
    p, g = sets
    return len(p & g) / len(p if of_pred else g)


def cell_precision(pred, gold) -> float:
    """Share of the prediction's distinct cell values that occur in the gold result (QATCH's cell precision):
    how much of what it returned is right, whatever the rows' shape."""
    return _shared_share(pred, gold, of_pred=True)


def cell_recall(pred, gold) -> float:
    """Share of the gold result's distinct cell values that occur in the prediction (QATCH's cell recall): how much
    of the answer it found."""
    return _shared_share(pred, gold, of_pred=False)


def tuple_cardinality(pred, gold) -> float:
    """min(rows) / max(rows) of the two results (QATCH's tuple cardinality): whether it returned as many rows as
    the gold. Rows as held: a bird-matched prediction past the row cap is held as its distinct rows."""
    n, m = len(pred), len(gold)
    return 1.0 if n == m else min(n, m) / max(n, m)
