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


def distill(candidates, neighbours: dict[str, int], cap: int) -> Distilled:
    """`neighbours`: question id -> how many neighbours it has (executable ones). `cap` >= 1."""
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    kept, told, filled = [], set(), set()
    for c in candidates:
        if len(kept) == cap:
            break
        if c.apart - told or c.nonempty - filled:
            kept.append(c.name)
            told |= c.apart
            filled |= c.nonempty
    coverage = {q: (sum((q, i) in told for i in range(n)) / n if n else None) for q, n in neighbours.items()}
    return Distilled(tuple(kept), coverage, tuple(q for q in neighbours if q not in filled))
