"""Filter: sample the policy K times per question, execute every SQL, bucket questions by pass rate.

args -> source data -> model -> sample K per question (chunks, resumable) -> buckets -> data check -> MLflow.
Pass rate counts execution *matches*, not the shaped reward. Every source question lands in exactly one
bucket: band (low < p < high), all_fail (0/K), all_pass (K/K), out_of_band "n/K" (e.g. 1/8 and 7/8 with the
seed's 0.2/0.8 band), or errors (missing database, gold that does not execute).

Resume: finished chunks are appended to `<out>.partial/passrates.jsonl`; a rerun (even after kill -9) with
the same output folder and parameters skips them. Chunk seeds depend only on the chunk's position, so a
resumed run gives the same result as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections import Counter
from pathlib import Path

from .configs import FilterConfig
from .data import db_path, dumps, read_gold, safe_text, write_json, write_jsonl
from .errors import DataError, SlmsqlError
from .outputs import check_free, partial_dir, promote

log = logging.getLogger(__name__)
CHUNK = 32  # questions per resumable unit
RESUME_KEYS = ("data", "db_root", "model", "adapter", "k", "temperature", "top_p", "max_new_tokens", "seed",
               "prompt_style", "example_values", "match", "timeout_s")


def bucket(n_correct: int, k: int, low: float, high: float) -> str:
    if n_correct == 0:
        return "all_fail"
    if n_correct == k:
        return "all_pass"
    return "band" if low < n_correct / k < high else f"{n_correct}/{k}"


def summarize(rows: list[dict], k: int, low: float, high: float) -> dict:
    counts = Counter(r["bucket"] for r in rows)
    out_of_band = {b: counts[b] for b in sorted((b for b in counts if "/" in b), key=lambda b: int(b.split("/")[0]))}
    return {"n_source": len(rows), "k": k, "low": low, "high": high,
            "buckets": {"band": counts["band"], "all_fail": counts["all_fail"], "all_pass": counts["all_pass"],
                        "out_of_band": out_of_band, "errors": counts["errors"]},
            "histogram": {f"{i}/{k}": sum(r.get("n_correct") == i and r["bucket"] != "errors" for r in rows)
                          for i in range(k + 1)},
            "error_ids": [r["id"] for r in rows if r["bucket"] == "errors"]}


def _load_done(path: Path, examples) -> list[dict]:
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


def histogram_figure(summary: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k, low, high = summary["k"], summary["low"], summary["high"]
    fig, ax = plt.subplots(figsize=(5, 3))
    for i, (label, n) in enumerate(summary["histogram"].items()):
        p = i / k
        color = "#36c" if low < p < high else ("#c63" if i in (0, k) else "#aaa")
        ax.bar(i, n, color=color)
    ax.set_xticks(range(k + 1), list(summary["histogram"]), fontsize=8)
    ax.set_xlabel(f"pass rate (blue: band {low} < p < {high}; grey: in no main bucket)")
    ax.set_ylabel("questions")
    fig.tight_layout()
    return fig


def main(cfg: FilterConfig) -> dict:
    import mlflow
    import pandas as pd
    from tqdm import tqdm

    from . import checks, tracking
    from .generation import sample
    from .models import check_adapter_base, load_model
    from .rewards import outcomes
    from .sandbox import Limits, SandboxPool

    # args
    if not (0 <= cfg.low < cfg.high <= 1) or cfg.k < 1:
        raise DataError(f"need k >= 1 and 0 <= low < high <= 1, got k={cfg.k} low={cfg.low} high={cfg.high}")
    examples = read_gold(cfg.data)
    if cfg.adapter:
        check_adapter_base(cfg.adapter, cfg.model)
    out = check_free(cfg.output_dir, cfg.overwrite)
    # A bad model path fails here, before a .partial folder and a run exist that a corrected rerun would
    # then refuse to resume ("unfinished run with other parameters").
    policy = load_model(cfg.model, cfg.adapter or None)
    work = partial_dir(out)
    work.mkdir(parents=True, exist_ok=True)
    identity = {k: getattr(cfg, k) for k in RESUME_KEYS}
    run_id = tracking.resume_state(work, identity)
    done = _load_done(work / "passrates.jsonl", examples)

    # model, sandbox, then sample chunk by chunk
    tags = {"slmsql.model": cfg.model, "slmsql.adapter": cfg.adapter}
    with tracking.stage_run("filter", cfg, tags=tags, run_id=run_id) as run:
        tracking.save_resume_state(work, identity, run.info.run_id)
        bar = tqdm(total=len(examples), initial=len(done), desc="filter", unit="q")
        with SandboxPool(cfg.workers or None, Limits(timeout_s=cfg.timeout_s)) as pool, \
                open(work / "passrates.jsonl", "a", encoding="utf-8") as sink:
            for start in range(len(done), len(examples), CHUNK):
                chunk = examples[start:start + CHUNK]
                have_db = [e for e in chunk if db_path(cfg.db_root, e.db_id).is_file()]
                chunk_cfg = dataclasses.replace(cfg, seed=cfg.seed * 1_000_003 + start)
                completions = dict(zip([e.id for e in have_db], sample(
                    chunk_cfg, have_db, k=cfg.k, temperature=cfg.temperature, top_p=cfg.top_p,
                    model_and_tokenizer=policy))) if have_db else {}
                rows = []
                for e in chunk:
                    row = {"id": e.id, "db_id": e.db_id, "k": cfg.k}
                    if e.id not in completions:
                        rows.append({**row, "bucket": "errors", "error": "missing database"})
                        continue
                    outs = outcomes(completions[e.id], [e.sql] * cfg.k,
                                    [str(db_path(cfg.db_root, e.db_id))] * cfg.k, pool, cfg.match)
                    if outs[0].status == "gold_error":
                        rows.append({**row, "bucket": "errors", "error": outs[0].error})
                        continue
                    n = sum(o.correct for o in outs)
                    rows.append({**row, "n_correct": n, "pass_rate": n / cfg.k,
                                 "bucket": bucket(n, cfg.k, cfg.low, cfg.high),
                                 "statuses": [("correct" if o.correct else o.status) for o in outs]})
                sink.write("".join(dumps(r) + "\n" for r in rows))
                sink.flush()
                os.fsync(sink.fileno())
                done += rows
                bar.update(len(chunk))
        bar.close()

        # buckets, band file, data check
        summary = summarize(done, cfg.k, cfg.low, cfg.high)
        by_id = {r["id"]: r for r in done}
        band = [{**e.to_json(), "pass_rate": by_id[e.id]["pass_rate"], "k": cfg.k,
                 "n_correct": by_id[e.id]["n_correct"]} for e in examples if by_id[e.id]["bucket"] == "band"]
        write_jsonl(work / "band.jsonl", band)
        write_json(work / "summary.json", summary)
        b = summary["buckets"]
        mlflow.log_metrics({"n_source": len(done), "band": b["band"], "all_fail": b["all_fail"],
                            "all_pass": b["all_pass"], "out_of_band": sum(b["out_of_band"].values()),
                            "errors": b["errors"], **{f"out_of_band_{k.replace('/', '_of_')}": v
                                                      for k, v in b["out_of_band"].items()}})
        mlflow.log_figure(histogram_figure(summary), "pass_rate_histogram.png")
        for name in ("band.jsonl", "passrates.jsonl", "summary.json"):
            mlflow.log_artifact(str(work / name))
        if band:
            mlflow.log_input(mlflow.data.from_pandas(pd.DataFrame(safe_text(band)), source=str(out / "band.jsonl"),
                                                     name="rl_band"), context="output")
        report = checks.run_rl_check(work / "band.jsonl", cfg.db_root, work / "summary.json", cfg.low, cfg.high)
        tracking.log_json(report.to_json(), "data_check/rl.json")
        mlflow.log_metric("data_check_success", float(report.success))
        if not report.success:
            raise SlmsqlError("the rl data check failed on the filter's own output:\n" + report.to_markdown())
    (work / "resume_state.json").unlink()
    promote(work, out)
    log.info("filter: %s", json.dumps(summary["buckets"]))
    return summary
