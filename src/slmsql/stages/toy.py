"""Toy: generate the embedded toy world (`toyworld`), then log its counts and the world itself to MLflow."""

from __future__ import annotations

import logging

from slmsql.configs import ToyConfig
from slmsql.inputs.data import DIFFICULTIES
from slmsql.toy.world import generate

log = logging.getLogger(__name__)


def main(cfg: ToyConfig) -> dict:
    import mlflow

    from slmsql.tracking import descriptions
    from slmsql.tracking import runs as tracking

    summary = generate(cfg.output_dir, cfg.seed, cfg.size, cfg.overwrite)
    with tracking.stage_run("toy", cfg):
        mlflow.log_metrics({f"{split}_{k}": v for split, c in summary["counts"].items() for k, v in c.items()})
        mlflow.log_metric("generate_seconds", summary["seconds"])
        mlflow.log_artifacts(str(cfg.output_dir), "toy")  # later steps take the world from the run
        tracking.describe(descriptions.toy_note(summary))
    for split, c in summary["counts"].items():
        log.info("%-10s %5d questions (%s)", split, c["total"], ", ".join(f"{d} {c[d]}" for d in DIFFICULTIES))
    return summary
