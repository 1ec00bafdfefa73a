"""Pass-rate buckets: where each question lands after K sampled answers were executed.

Pass rate counts execution *matches*, not the shaped reward. Every question lands in exactly one bucket: band
(low < p < high), all_fail (0/K), all_pass (K/K), out_of_band "n/K" (e.g. 1/8 and 7/8 with the seed's 0.2/0.8
band: a three-bucket report silently drops them), or errors (missing database, gold that does not execute or
whose result is over the sandbox's digest budget).
`question_rows` is the per-question work both engines (`engines`) run; `inputs.data.load_finished` the resume rule.
"""

from __future__ import annotations

from collections import Counter

CHUNK = 32  # questions per generate-and-score round of the local engine (and per shard of the Ray engine)


def question_rows(examples, completions: dict[str, list[str]], *, db_root, k: int, low: float, high: float,
                  match: str, executor) -> list[dict]:
    """One passrates row per example, in order. `completions` maps id -> K completions; an example without
    them had no database (the generation step skips those)."""
    from slmsql.inputs.data import db_path
    from slmsql.sql.scoring import GOLD_STATUSES, outcomes

    rows = []
    for e in examples:
        row = {"id": e.id, "db_id": e.db_id, "k": k}
        if e.id not in completions:
            rows.append({**row, "bucket": "errors", "error": "missing database"})
            continue
        outs = outcomes(completions[e.id], [e.sql] * k, [str(db_path(db_root, e.db_id))] * k, executor, match)
        if outs[0].status in GOLD_STATUSES:
            rows.append({**row, "bucket": "errors", "error": outs[0].error})
            continue
        n = sum(o.correct for o in outs)
        rows.append({**row, "n_correct": n, "pass_rate": n / k, "bucket": bucket(n, k, low, high),
                     "statuses": [o.outcome for o in outs]})
    return rows


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
