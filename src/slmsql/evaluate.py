"""Evaluate: execution accuracy (EX) of a predictions file or a model, with intervals and a paired test.

args -> gold data -> predictions (file, or greedy generation) -> sandboxed scoring -> statistics -> MLflow.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from . import stats
from .configs import EvaluateConfig
from .data import check_databases, read_gold, read_jsonl, safe_text, write_json, write_jsonl
from .errors import DataError, SlmsqlError
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


def fetch_baseline(run_id: str, dataset: str, match: str, gold_ids: list[str]) -> dict[str, bool]:
    """The baseline run's per-example correctness, refused unless it scored the same questions the same way."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient()
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise SlmsqlError(f"baseline run {run_id!r} does not exist in {mlflow.get_tracking_uri()}") from None
    tags = run.data.tags
    if tags.get("slmsql.stage") != "evaluate":
        raise SlmsqlError(f"baseline run {run_id} is not an evaluate run (stage {tags.get('slmsql.stage')!r})")
    for key, want in (("slmsql.dataset", dataset), ("slmsql.match", match)):
        if tags.get(key) != want:
            raise SlmsqlError(f"baseline run {run_id} has {key}={tags.get(key)!r}, this run {want!r}: "
                              "paired comparison needs the same dataset and match mode")
    with tempfile.TemporaryDirectory() as d:
        path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="results.jsonl", dst_path=d)
        rows = read_jsonl(path)
    correct = {str(r["id"]): bool(r["correct"]) for r in rows}
    if sorted(correct) != sorted(gold_ids):
        raise SlmsqlError(f"baseline run {run_id} scored a different set of questions "
                          f"({len(correct)} vs {len(gold_ids)} ids)")
    return correct


def ex_figure(metrics: dict, comparison: dict | None, label: str):
    """EX with Wilson intervals, this run beside its baseline: the picture a reader checks first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(label, metrics["ex"], metrics["ex_ci_low"], metrics["ex_ci_high"])]
    if comparison:
        bars.insert(0, ("baseline", comparison["ex_b"], comparison["ex_b_ci_low"], comparison["ex_b_ci_high"]))
    fig, ax = plt.subplots(figsize=(4, 3))
    for i, (name, ex, lo, hi) in enumerate(bars):
        ax.bar(i, ex * 100, color="#8aa" if name == "baseline" else "#36c")
        # clamped: statsmodels' Wilson bound for k == n is 0.9999999999999999, and a negative yerr raises
        ax.errorbar(i, ex * 100, yerr=[[max(0.0, 100 * (ex - lo))], [max(0.0, 100 * (hi - ex))]], color="k",
                    capsize=6)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars])
    ax.set_ylabel("EX % (95% Wilson)")
    ax.set_ylim(0, 100)
    if comparison:
        ax.set_title(f"{comparison['verdict']} (McNemar p={comparison['mcnemar_p']:.3g})", fontsize=9)
    fig.tight_layout()
    return fig


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
    baseline = None
    if cfg.baseline_run:  # checked before any model loads
        tracking.configure()
        baseline = fetch_baseline(cfg.baseline_run, dataset, cfg.match, [e.id for e in examples])
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
        comparison = None
        if baseline is not None:
            comparison = stats.compare([r["correct"] for r in results], [baseline[r["id"]] for r in results],
                                       alpha=cfg.alpha, seed=cfg.seed)
            metrics["comparison"] = {"baseline_run": cfg.baseline_run, **comparison}
            mlflow.log_metrics({f"vs_baseline_{k}": v for k, v in tracking.numeric(comparison).items()})
            mlflow.set_tags({"slmsql.baseline_run": cfg.baseline_run, "slmsql.verdict": comparison["verdict"]})
            log.info("vs baseline: %+.1f points, McNemar p=%.3g -> %s", 100 * comparison["diff"],
                     comparison["mcnemar_p"], comparison["verdict"])
        missing = sum(r["status"] == "missing" for r in results)
        if missing:
            log.warning("%d gold examples have no prediction; scored wrong", missing)
        write_jsonl(work / "results.jsonl", results)
        write_json(work / "metrics.json", metrics)
        mlflow.log_metrics(tracking.numeric(metrics))
        mlflow.log_figure(ex_figure(metrics, comparison, cfg.run_name or "this run"), "ex_intervals.png")
        log.info("EX %.1f%% [%.1f, %.1f] on %d examples of %s (%s)", 100 * metrics["ex"],
                 100 * metrics["ex_ci_low"], 100 * metrics["ex_ci_high"], metrics["n"], dataset, cfg.match)
        for name in ("results.jsonl", "metrics.json", "predictions.jsonl"):
            if (work / name).exists():
                mlflow.log_artifact(str(work / name))
        import pandas as pd

        mlflow.log_table(pd.DataFrame(safe_text(results)).astype({"pred_ms": "float64"}), "results_table.json")
    return metrics
