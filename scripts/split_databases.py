"""Split a benchmark's databases into a training half and a held-out half, with a seed, and print the two lists
as a study declares them (`band: {db_ids: [...]}`, an eval set's `db_ids: [...]`):

    python scripts/split_databases.py .cache/spider/dev.json --seed 0

The databases (each question's db_id) are sorted by name, shuffled with `random.Random(seed)`, and the first
half (rounded down) trains; the rest is held out. A question's database decides its side, so no held-out question
shares a schema with a training one. Same file and seed, same lists, on any machine.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys

from slmsql.errors import SlmsqlError
from slmsql.inputs.data import read_gold


def split(db_ids: list[str], seed: int) -> tuple[list[str], list[str]]:
    """(training, held-out) databases, each sorted: the distinct `db_ids` shuffled with `seed`, halved."""
    dbs = sorted(set(db_ids))
    random.Random(seed).shuffle(dbs)
    half = len(dbs) // 2
    return sorted(dbs[:half]), sorted(dbs[half:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", help="gold file (Spider/BIRD .json, or slmsql's .jsonl)")
    ap.add_argument("--seed", type=int, required=True)
    args = ap.parse_args(argv)
    try:
        counts = collections.Counter(e.db_id for e in read_gold(args.data))
    except SlmsqlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(counts) < 2:
        print(f"error: {args.data}: {len(counts)} database(s): nothing to split", file=sys.stderr)
        return 2
    train, held = split(list(counts), args.seed)
    for name, dbs in (("train", train), ("held_out", held)):
        print(f"# {name}: {len(dbs)} databases, {sum(counts[d] for d in dbs)} questions (seed {args.seed})")
        print(f"{name}: [{', '.join(dbs)}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
