"""Evaluate: execution accuracy (EX) of a predictions file or a model, with intervals and a paired test.

args -> gold data -> predictions (file, or greedy generation) -> sandboxed scoring -> statistics -> MLflow.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .configs import EvaluateConfig
from .data import check_databases, read_gold, read_jsonl, write_jsonl
from .errors import DataError
from .outputs import check_free, staged
from .sandbox import Limits, SandboxPool
from .scoring import score_predictions, summarize

log = logging.getLogger(__name__)


def read_predictions(path, gold_ids: set[str]) -> dict[str, dict]:
    preds: dict[str, dict] = {}
    for n, row in enumerate(read_jsonl(path), 1):
        if not isinstance(row, dict) or row.get("id") is None:
            raise DataError("missing", path, n, "id")
        if not isinstance(row.get("sql"), str) and not isinstance(row.get("completion"), str):
            raise DataError("needs a string 'sql' or 'completion'", path, n, "sql")
        pid = str(row["id"])
        if pid in preds:
            raise DataError(f"duplicate id {pid!r}", path, n, "id")
        if pid not in gold_ids:
            raise DataError(f"id {pid!r} is not in the gold file", path, n, "id")
        preds[pid] = row
    if not preds:
        raise DataError("no predictions", path)
    return preds


def main(cfg: EvaluateConfig) -> dict:
    import mlflow

    from . import tracking

    examples = read_gold(cfg.data)
    check_databases(examples, cfg.db_root, cfg.data)
    check_free(cfg.output_dir, cfg.overwrite)
    if cfg.predictions:
        preds = read_predictions(cfg.predictions, {e.id for e in examples})
    elif not cfg.model:
        raise DataError("give --predictions FILE or --model M")
    dataset = cfg.dataset_name or Path(cfg.data).stem
    tags = {"slmsql.dataset": dataset, "slmsql.match": cfg.match,
            "slmsql.model": cfg.model or "predictions-file", "slmsql.adapter": cfg.adapter or ""}
    with staged(cfg.output_dir, cfg.overwrite) as work, tracking.stage_run("evaluate", cfg, tags=tags):
        if not cfg.predictions:
            from .generation import predict  # heavy imports (torch, transformers) only when generating

            preds = predict(cfg, examples)
            write_jsonl(work / "predictions.jsonl", [{"id": k, **v} for k, v in preds.items()])
        limits = Limits(timeout_s=cfg.timeout_s)
        with SandboxPool(cfg.workers or None, limits) as pool:
            results = score_predictions(examples, preds, cfg.db_root, pool, cfg.match)
        metrics = summarize(results)
        missing = sum(r["status"] == "missing" for r in results)
        if missing:
            log.warning("%d gold examples have no prediction; scored wrong", missing)
        write_jsonl(work / "results.jsonl", results)
        (work / "metrics.json").write_text(json.dumps(metrics, indent=2))
        mlflow.log_metrics(tracking.numeric(metrics))
        for name in ("results.jsonl", "metrics.json", "predictions.jsonl"):
            if (work / name).exists():
                mlflow.log_artifact(str(work / name))
        import pandas as pd

        mlflow.log_table(pd.DataFrame(results).astype({"pred_ms": "float64"}), "results_table.json")
    return metrics
