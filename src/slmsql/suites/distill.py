"""Distillation: from many generated databases, keep the few that tell golds from their neighbours.

After Zhong, Yu and Klein (EMNLP 2020, sec. 3.3), written from the paper's description: candidates are looked at
in the order they were generated (a seed fixes it); one is kept when it tells apart a (question, neighbour)
pair that no kept database tells apart yet, or when it is the first on which some question's gold returns rows
(every gold must be non-empty on at least one database of its suite), until `cap` databases are kept.
The result says, for each question, the share of its neighbours the kept suite tells apart, and which questions
have no database where their gold returns rows (listed by id by the caller, with the reason).
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
    kept: tuple[str, ...]
    coverage: dict  # question id -> share of its neighbours the kept databases tell apart (None: no neighbours)
    empty: tuple[str, ...]  # question ids whose gold returns no rows on any kept database


class Distiller:
    """The rule, one candidate at a time: `offer` keeps a candidate that tells apart a pair no kept one does, or
    fills a gold no kept one does, until `cap`. `told` and `filled` are what the kept ones cover so far: a builder
    need not compute a candidate's pairs that are in `told` (they cannot make it kept)."""

    def __init__(self, neighbours: dict[str, int], cap: int):
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        self.neighbours, self.cap = neighbours, cap
        self.kept: list[str] = []
        self.told: set = set()
        self.filled: set = set()

    @property
    def full(self) -> bool:
        return len(self.kept) == self.cap

    def offer(self, c: Candidate) -> bool:
        if self.full or not (c.apart - self.told or c.nonempty - self.filled):
            return False
        self.kept.append(c.name)
        self.told |= c.apart
        self.filled |= c.nonempty
        return True

    def result(self) -> Distilled:
        told = self.told
        coverage = {q: (sum((q, i) in told for i in range(n)) / n if n else None) for q, n in self.neighbours.items()}
        return Distilled(tuple(self.kept), coverage, tuple(q for q in self.neighbours if q not in self.filled))


def distill(candidates, neighbours: dict[str, int], cap: int) -> Distilled:
    """`neighbours`: question id -> how many neighbours it has (executable ones). `cap` >= 1. Candidates are taken
    from the iterable only until the cap is reached."""
    d = Distiller(neighbours, cap)
    for c in candidates:
        if d.full:
            break
        d.offer(c)
    return d.result()
