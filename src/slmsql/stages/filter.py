"""Filter: sample the policy K times per question, execute every SQL, bucket questions by pass rate.

args -> source data -> model -> sample K per question (chunks, resumable) -> buckets -> data check -> MLflow.
Buckets are defined in `passrates`. Resume: finished chunks are appended to `<out>.partial/passrates.jsonl`;
a rerun (even after kill -9) with the same output folder and parameters skips them. Chunk seeds depend only
on the chunk's position, so a resumed run gives the same result as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from ..configs import FilterConfig
from ..data import db_path, dumps, read_gold, write_json, write_jsonl
from ..errors import DataError, SlmsqlError
from ..outputs import Staged
from ..figures import histogram_figure
from ..passrates import CHUNK, bucket, bucket_summary, load_finished

log = logging.getLogger(__name__)
RESUME_KEYS = ("data", "db_root", "model", "adapter", "k", "temperature", "top_p", "max_new_tokens", "seed",
               "prompt_style", "example_values", "match", "timeout_s")


def main(cfg: FilterConfig) -> dict:
    import mlflow
    from tqdm import tqdm

    from .. import datachecks, tracking
    from ..generation import complete
    from ..models import check_adapter_base, load_model
    from ..sandbox import Limits, SandboxPool
    from ..scoring import outcomes

    # args
    if not (0 <= cfg.low < cfg.high <= 1) or cfg.k < 1:
        raise DataError(f"need k >= 1 and 0 <= low < high <= 1, got k={cfg.k} low={cfg.low} high={cfg.high}")
    examples = read_gold(cfg.data)
    if cfg.adapter:
        check_adapter_base(cfg.adapter, cfg.model)
    st = Staged(cfg.output_dir, cfg.overwrite, identity={k: getattr(cfg, k) for k in RESUME_KEYS})
    # A bad model path fails here, before a .partial folder and a run exist that a corrected rerun would
    # then refuse to resume ("unfinished run with other parameters").
    policy = load_model(cfg.model, cfg.adapter or None)

    # model, sandbox, then sample chunk by chunk
    tags = {"slmsql.model": cfg.model, "slmsql.adapter": cfg.adapter}
    with st, tracking.stage_run("filter", cfg, tags=tags, run_id=st.run_id, system_metrics=True) as run:
        st.bind(run.info.run_id)
        work, out = st.work, st.out
        done = load_finished(work / "passrates.jsonl", examples)
        bar = tqdm(total=len(examples), initial=len(done), desc="filter", unit="q")
        with SandboxPool(cfg.workers or None, Limits(timeout_s=cfg.timeout_s)) as pool, \
                open(work / "passrates.jsonl", "a", encoding="utf-8") as sink:
            for start in range(len(done), len(examples), CHUNK):
                chunk = examples[start:start + CHUNK]
                have_db = [e for e in chunk if db_path(cfg.db_root, e.db_id).is_file()]
                chunk_cfg = dataclasses.replace(cfg, seed=cfg.seed * 1_000_003 + start)
                completions = dict(zip([e.id for e in have_db], complete(
                    chunk_cfg, have_db, policy, k=cfg.k, temperature=cfg.temperature, top_p=cfg.top_p))) \
                    if have_db else {}
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
                                 "statuses": [o.outcome for o in outs]})
                sink.write("".join(dumps(r) + "\n" for r in rows))
                sink.flush()
                os.fsync(sink.fileno())
                done += rows
                bar.update(len(chunk))
        bar.close()

        # buckets, band file, data check
        summary = bucket_summary(done, cfg.k, cfg.low, cfg.high)
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
        if band:  # named as GRPO names its input: one name for one dataset
            tracking.log_dataset(band, "rl", out / "band.jsonl", context="output")
        tracking.describe(tracking.filter_note(summary))
        report = datachecks.run_rl_check(work / "band.jsonl", cfg.db_root, work / "summary.json", cfg.low, cfg.high)
        tracking.log_json(report.to_json(), "data_check/rl.json")
        mlflow.log_metric("data_check_success", float(report.success))
        if not report.success:
            raise SlmsqlError("the rl data check failed on the filter's own output:\n" + report.to_markdown())
    log.info("filter: %s", json.dumps(summary["buckets"]))
    return summary
