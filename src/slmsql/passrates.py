"""Pass-rate buckets: where each question lands after K sampled answers were executed.

Pass rate counts execution *matches*, not the shaped reward. Every question lands in exactly one bucket: band
(low < p < high), all_fail (0/K), all_pass (K/K), out_of_band "n/K" (e.g. 1/8 and 7/8 with the seed's 0.2/0.8
band: a three-bucket report silently drops them), or errors (missing database, gold that does not execute).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .data import write_jsonl
from .errors import SlmsqlError

CHUNK = 32  # questions per resumable unit of the filter


def bucket(n_correct: int, k: int, low: float, high: float) -> str:
    if n_correct == 0:
        return "all_fail"
    if n_correct == k:
        return "all_pass"
    return "band" if low < n_correct / k < high else f"{n_correct}/{k}"


def bucket_summary(rows: list[dict], k: int, low: float, high: float) -> dict:
    counts = Counter(r["bucket"] for r in rows)
    out_of_band = {b: counts[b] for b in sorted((b for b in counts if "/" in b), key=lambda b: int(b.split("/")[0]))}
    return {"n_source": len(rows), "k": k, "low": low, "high": high,
            "buckets": {"band": counts["band"], "all_fail": counts["all_fail"], "all_pass": counts["all_pass"],
                        "out_of_band": out_of_band, "errors": counts["errors"]},
            "histogram": {f"{i}/{k}": sum(r.get("n_correct") == i and r["bucket"] != "errors" for r in rows)
                          for i in range(k + 1)},
            "error_ids": [r["id"] for r in rows if r["bucket"] == "errors"]}


def load_finished(path: Path, examples) -> list[dict]:
    """Rows of fully finished chunks; a torn last line or a half-written chunk is dropped and redone."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    done = len(rows) - len(rows) % CHUNK if len(rows) < len(examples) else len(examples)
    rows = rows[:done]
    if [r["id"] for r in rows] != [e.id for e in examples[:done]]:
        raise SlmsqlError(f"{path} does not match the source questions; delete {path.parent} to start over")
    write_jsonl(path, rows)
    return rows
