"""Multistep workflows (MLflow's pattern), shared by `pipeline` and `sweep`: each step is its own
`mlflow.run` (local env manager) child of one parent run, and a finished step whose parameters and code
version match is reused instead of re-run.

Steps hand each other their outputs by run URI (artifacts downloaded from the tracking store, so a remote
server works the same).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

log = logging.getLogger(__name__)
PACKAGE = Path(__file__).resolve().parent  # src/slmsql
ROOT = PACKAGE.parents[1]  # the MLproject folder


def code_version() -> str:
    """Hash of everything that shapes a step's result: the whole package, the data-check suites and the card
    template. A reused step must have been produced by this code."""
    h = hashlib.sha256()
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "data_checks").glob("*.json"), *(ROOT / "model_card").glob("*")]
    for f in sorted(f for f in files if f.is_file() and "__pycache__" not in f.parts):
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def use_this_cli() -> None:
    """`mlflow run` starts each step as `slmsql <stage>`: make this environment's CLI the one it finds."""
    import os
    import sys

    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


class Steps:
    """The steps of one workflow run: each writes to `output_dir`/<name> unless given its own output_dir, and
    gets `seed` unless given its own; `overrides` ({"<stage>.<field>": value}) apply to every step of that
    stage, after the step's own parameters."""

    def __init__(self, experiment_id: str, *, output_dir, experiment: str, seed: int = 0, reuse: bool = True,
                 overrides: dict | None = None):
        import mlflow

        self.experiment_id, self.experiment, self.seed, self.reuse = experiment_id, experiment, seed, reuse
        self.overrides, self.version = dict(overrides or {}), code_version()
        self.client = mlflow.MlflowClient()
        self.out = Path(output_dir).resolve()
        self.reused: list[str] = []  # run ids reused by this workflow run

    def params(self, stage: str, name: str, given: dict) -> dict:
        extra = {k.split(".", 1)[1]: v for k, v in self.overrides.items() if k.split(".", 1)[0] == stage}
        return {"output_dir": str(self.out / name), "experiment": self.experiment, "run_name": name,
                "seed": self.seed, **given, **extra}

    def find(self, stage: str, params: dict):
        """The latest finished run of `stage` by this code version with exactly these parameters, or None."""
        runs = self.client.search_runs(
            [self.experiment_id], f"tags.`slmsql.stage` = '{stage}' and tags.`slmsql.code_version` = "
            f"'{self.version}' and attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"])
        for run in runs:
            if all(run.data.params.get(k) == str(v) for k, v in params.items() if k != "overwrite"):
                return run
        return None

    def run(self, stage: str, name: str, tags: dict | None = None, **given):
        """Run (or reuse) one step; returns its finished MLflow run. `tags` go on the step's run as it starts
        (a reused run keeps the tags it was made with)."""
        import mlflow
        from mlflow.exceptions import ExecutionException

        params = self.params(stage, name, given)
        if self.reuse and (found := self.find(stage, params)):
            log.info("step %-14s reused run %s", name, found.info.run_id)
            self.reused.append(found.info.run_id)
            return found
        log.info("step %-14s running ...", name)
        sub = mlflow.run(str(ROOT), entry_point=stage.replace("-", "_"), env_manager="local",
                         experiment_id=self.experiment_id, run_name=name,
                         parameters={**params, "overwrite": "true"}, synchronous=False)
        # started without waiting, so the tags are on the run while it runs; then waited for as
        # `synchronous=True` would (which also marks a run its process left RUNNING)
        try:
            self.client.set_tag(sub.run_id, "slmsql.code_version", self.version)
            for key, value in (tags or {}).items():
                self.client.set_tag(sub.run_id, key, str(value))
            ok = sub.wait()
        except BaseException:  # Ctrl-C or an error here: do not leave the step running on its own
            sub.cancel()
            self._terminate(sub.run_id, "FAILED")
            raise
        self._terminate(sub.run_id, "FINISHED" if ok else "FAILED")
        if not ok:
            raise ExecutionException(f"step {name} ({stage}) failed: MLflow run {sub.run_id}")
        return self.client.get_run(sub.run_id)

    def _terminate(self, run_id: str, status: str) -> None:
        if self.client.get_run(run_id).info.status == "RUNNING":
            self.client.set_terminated(run_id, status)

    def artifact(self, run, path: str) -> str:
        """A step's output, fetched by run URI into a stable folder (a stable path keeps reuse matching)."""
        import mlflow

        dst = self.out / "from-runs" / run.info.run_id
        if (dst / path).exists():
            return str(dst / path)
        dst.mkdir(parents=True, exist_ok=True)
        return mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path=path, dst_path=str(dst))
