"""MLflow set-up shared by every stage: where runs go, failing fast, and what never gets logged."""

from __future__ import annotations

import contextlib
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from . import distributed
from .data import write_json
from .errors import SlmsqlError

DEFAULT_URI = "sqlite:///mlflow.db"  # embedded default: a SQLite store in the working folder


def configure() -> str:
    """Pick the tracking URI (MLFLOW_TRACKING_URI wins), turn telemetry off, and check a server answers."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # A dead server otherwise costs minutes of retries before the first error.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    uri = os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + os.path.abspath(uri[len("sqlite:///"):])
    os.environ["MLFLOW_TRACKING_URI"] = uri  # steps started by `mlflow run` must write to the same store
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5) as r:
                r.read()
        except (urllib.error.URLError, OSError) as e:
            raise SlmsqlError(f"MLflow tracking server {uri} is unreachable ({getattr(e, 'reason', e)}); "
                              "start one with `slmsql server` or unset MLFLOW_TRACKING_URI") from None
    import mlflow

    mlflow.set_tracking_uri(uri)
    return uri


@contextlib.contextmanager
def stage_run(stage: str, cfg, params: dict | None = None, tags: dict | None = None, run_id: str | None = None):
    """Start (or, under `mlflow run` or on resume, reuse) the run for one stage, with its config as params.

    Launched as several processes, the main process alone starts and logs the run; the others get a stand-in
    holding the run's id and must log nothing (an MLflow call there would start a second run). The run records
    the world size and the launcher."""
    import types

    import mlflow

    from .configs import to_params

    params = {**to_params(cfg), **(params or {})}
    if not distributed.is_main():
        yield types.SimpleNamespace(info=types.SimpleNamespace(run_id=distributed.receive()))
        return
    with distributed.sending() as send:
        configure()
        run_id = run_id or os.environ.get("MLFLOW_RUN_ID")
        if not run_id:
            mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.experiment)
        nested = mlflow.active_run() is not None
        with mlflow.start_run(run_id=run_id, run_name=None if run_id else (cfg.run_name or stage),
                              nested=nested) as run:
            mlflow.set_tags({"slmsql.stage": stage, "slmsql.world_size": str(distributed.world_size()),
                             "slmsql.launcher": distributed.launcher(), **(tags or {})})
            logged = mlflow.get_run(run.info.run_id).data.params
            new = {k: v[:6000] for k, v in params.items() if k not in logged}
            if new:  # params are immutable: a resumed run logs only what it has not logged yet
                mlflow.log_params(new)
            send(run.info.run_id)
            yield run


def stage_run_of(client, run_id: str, stage: str, role: str, finished: bool = True):
    """The run `run_id`, refused unless it exists, is a `stage` run and (by default) finished.
    `role` names it in errors ("baseline", "GRPO", ...)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise SlmsqlError(f"{role} run {run_id!r} does not exist in {mlflow.get_tracking_uri()}") from None
    got = run.data.tags.get("slmsql.stage")
    if got != stage:
        raise SlmsqlError(f"{role} run {run_id} has stage {got!r}, expected {stage!r}")
    if finished and run.info.status != "FINISHED":
        raise SlmsqlError(f"{role} run {run_id} is {run.info.status}: use only finished runs")
    return run


def download(run_id: str, path: str, dst) -> Path:
    """One artifact of a run, with a clear error when the run has no such artifact."""
    import mlflow
    from mlflow.exceptions import MlflowException

    Path(dst).mkdir(parents=True, exist_ok=True)
    try:
        return Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=path, dst_path=str(dst)))
    except (MlflowException, OSError) as e:
        raise SlmsqlError(f"run {run_id} has no artifact {path!r} ({e})") from None


def log_json(obj, artifact_file: str) -> None:
    import mlflow

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / Path(artifact_file).name
        write_json(p, obj, default=str)
        mlflow.log_artifact(str(p), str(Path(artifact_file).parent) if "/" in artifact_file else None)


def numeric(metrics: dict) -> dict:
    """Only the finite numbers: MLflow metrics refuse strings, and inf means 'not computable' here."""
    import math

    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def metric_name(key: str) -> str:
    """TRL's keys carry spaces and colons ('profiling/Time taken: ...'); MLflow keeps [\\w./-] safely."""
    import re

    return re.sub(r"_+", "_", re.sub(r"[^\w./-]", "_", key)).strip("_")


def backend_store_uri(store) -> str:
    """`store` as an MLflow backend store URI: a URI (postgresql://..., mysql://..., sqlite:///...) is kept
    as given; anything else is a SQLite file, made absolute so the server finds it whatever its cwd."""
    store = str(store)
    if "://" in store:
        return store
    return f"sqlite:///{Path(store).resolve()}"


def server_command(host: str, port: int, store, artifacts: Path) -> list[str]:
    """A real `mlflow server` on loopback with served artifacts, and without the job runner (which would
    start 7 more workers and ~2 GB for features slmsql does not use). `store`: a SQLite file or a URI."""
    import sys

    return [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port),
            "--backend-store-uri", backend_store_uri(store),
            "--serve-artifacts", "--artifacts-destination", str(Path(artifacts).resolve()), "--workers", "1"]


def start_server(host="127.0.0.1", port=5000, store="mlflow-server.db", artifacts="mlartifacts",
                 timeout_s: float = 60, log_file=None):
    """Start the server, wait until /health answers, return (process, uri). `port=0` picks a free port.
    `store` is a SQLite file or a backend store URI (e.g. postgresql://user:pw@host:port/db)."""
    import socket
    import subprocess
    import time

    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]

    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen(server_command(host, port, store, Path(artifacts)), env=env,
                            stdout=log_file or subprocess.DEVNULL, stderr=subprocess.STDOUT)
    uri = f"http://{host}:{port}"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SlmsqlError(f"mlflow server exited with code {proc.returncode} (port {port} in use?)")
        try:
            with urllib.request.urlopen(uri + "/health", timeout=2):
                return proc, uri
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise SlmsqlError(f"mlflow server on {uri} did not become healthy within {timeout_s:.0f} s")


def runs_table(experiment: str = "slmsql", limit: int = 20) -> str:
    """The latest runs, one line each, with the metrics that matter for their stage."""
    import mlflow

    from .configs import STAGES

    configure()
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise SlmsqlError(f"no experiment {experiment!r} in {mlflow.get_tracking_uri()}")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=limit)
    lines = [f"{'run':<20} {'stage':<10} {'status':<9} {'run id':<32}  metrics"]
    for r in reversed(runs):
        stage = r.data.tags.get("slmsql.stage", "?")
        shown = []
        for k in getattr(STAGES.get(stage), "key_metrics", ()):
            if k in r.data.metrics:
                v = r.data.metrics[k]
                shown.append(f"{k.split('/')[-1]}={v:.3g}")
        if "slmsql.verdict" in r.data.tags:
            shown.append(r.data.tags["slmsql.verdict"])
        lines.append(f"{(r.info.run_name or '')[:20]:<20} {stage:<10} {r.info.status:<9} {r.info.run_id:<32}  "
                     + " ".join(shown))
    return "\n".join(lines)
