"""Validate: the Great Expectations data checks (`datachecks`) on an RL band or an eval set, as a stage."""

from __future__ import annotations

from slmsql.checks.datachecks import Report, validate
from slmsql.errors import SlmsqlError
from slmsql.inputs.data import safe_text, write_json
from slmsql.runtime.outputs import Staged


def main(cfg) -> Report:
    """`slmsql validate`: write OUT/validation.{json,md}, log them and the counts to MLflow.

    A failing suite is still a complete result: the report is written (the staged folder is renamed into
    place) and logged first, then SlmsqlError is raised inside the MLflow run, so the run ends FAILED and
    the CLI prints the failed expectations and exits 2. Unreadable input raises DataError before any run.
    """
    import mlflow

    from slmsql.tracking import descriptions
    from slmsql.tracking import runs as tracking

    st = Staged(cfg.output_dir, cfg.overwrite)  # refused before the slow part if the folder is in the way
    report = validate(cfg.kind, cfg.data, cfg.db_root, summary=cfg.summary or None, eval_sets=cfg.eval_sets,
                      low=cfg.low, high=cfg.high, min_band=cfg.min_band)
    with tracking.stage_run("validate", cfg, tags={"slmsql.validate.kind": cfg.kind,
                                                   "slmsql.validate.success": str(report.success).lower()}):
        with st:
            write_json(st.work / "validation.json", report.to_json(), default=str)
            (st.work / "validation.md").write_text(safe_text(report.to_markdown()), encoding="utf-8")
        for name in ("validation.json", "validation.md"):
            mlflow.log_artifact(str(st.out / name))
        mlflow.log_metrics({"n_expectations": len(report.results), "n_failed": len(report.failed),
                            "success": float(report.success), "n_rows": report.n_rows,
                            "gx_seconds": report.gx_seconds})
        tracking.describe(descriptions.validate_note(report))
        if not report.success:
            raise SlmsqlError(report.failure_message(st.out / "validation.md"))
    return report
