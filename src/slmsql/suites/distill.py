"""Distillation: from many generated databases, keep the few that tell golds from their neighbours.

After Zhong, Yu and Klein (EMNLP 2020, sec. 3.3), written from the paper's description, in two passes:
1. **Scan.** Candidates are looked at in the order they were generated (a seed fixes it); one joins the pool when
   it tells apart a (question, neighbour) pair that no pooled database tells apart yet, or is the first on which
   some question's gold returns rows. Every candidate of the budget is looked at (or until nothing is left to
   tell apart or fill): stopping at the cap instead filled it with the first few candidates, each of which told
   apart something easy, and left the hard pairs (a gold's duplicate rows, a gold that needs large tables to
   return anything) to candidates never generated.
2. **Select.** Up to `cap` pooled databases, greedily: each time the one that fills the most golds still empty,
   then tells apart the most pairs still untold, the earlier generated on a tie; until the cap or until none
   adds anything. A pooled database's pairs are those untold when it was scanned (the builder judges only
   those), so the greedy choice works on what the scan saw.
The result says, for each question, the share of its neighbours the kept suite tells apart, and which questions
have no kept database where their gold returns rows (listed by id by the caller, with the reason).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    name: str
    apart: frozenset  # (question id, neighbour index) pairs whose results differ on this database
    nonempty: frozenset  # question ids whose gold returns rows on this database


@dataclass(frozen=True)
class Distilled:
    kept: tuple[str, ...]  # in the order chosen: the first is the one that adds most
    coverage: dict  # question id -> share of its neighbours the kept databases tell apart (None: no neighbours)
    empty: tuple[str, ...]  # question ids whose gold returns no rows on any kept database


class Distiller:
    """The scan, one candidate at a time (`offer`), then the selection (`result`). `told` and `filled` are what
    the pool covers so far: a builder need not compute a candidate's pairs in `told` (they cannot pool it), and
    can stop generating once `complete`."""

    def __init__(self, neighbours: dict[str, int], cap: int):
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        self.neighbours, self.cap = neighbours, cap
        self.pool: list[Candidate] = []
        self.told: set = set()
        self.filled: set = set()

    @property
    def complete(self) -> bool:
        """Every pair told apart and every gold filled by the pool: no later candidate could join it."""
        return len(self.filled) == len(self.neighbours) and len(self.told) == sum(self.neighbours.values())

    def offer(self, c: Candidate) -> bool:
        if not (c.apart - self.told or c.nonempty - self.filled):
            return False
        self.pool.append(c)
        self.told |= c.apart
        self.filled |= c.nonempty
        return True

    def result(self) -> Distilled:
        kept, told, filled, left = [], set(), set(), list(self.pool)
        while left and len(kept) < self.cap:
            gain = [(len(c.nonempty - filled), len(c.apart - told), -i) for i, c in enumerate(left)]
            best = max(range(len(left)), key=gain.__getitem__)
            if gain[best][:2] == (0, 0):
                break
            c = left.pop(best)
            kept.append(c.name)
            told |= c.apart
            filled |= c.nonempty
        coverage = {q: (sum((q, i) in told for i in range(n)) / n if n else None) for q, n in self.neighbours.items()}
        return Distilled(tuple(kept), coverage, tuple(q for q in self.neighbours if q not in filled))


def distill(candidates, neighbours: dict[str, int], cap: int) -> Distilled:
    """`neighbours`: question id -> how many neighbours it has (executable ones). `cap` >= 1."""
    d = Distiller(neighbours, cap)
    for c in candidates:
        d.offer(c)
    return d.result()
