"""MLflow set-up shared by every stage: where runs go, failing fast, and what never gets logged."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

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
    """Start (or, under `mlflow run` or on resume, reuse) the run for one stage, with its config as params."""
    import mlflow

    from .configs import to_params

    configure()
    run_id = run_id or os.environ.get("MLFLOW_RUN_ID")
    if not run_id:
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.experiment)
    nested = mlflow.active_run() is not None
    with mlflow.start_run(run_id=run_id, run_name=None if run_id else (cfg.run_name or stage), nested=nested) as run:
        mlflow.set_tags({"slmsql.stage": stage, **(tags or {})})
        logged = mlflow.get_run(run.info.run_id).data.params
        new = {k: v[:6000] for k, v in {**to_params(cfg), **(params or {})}.items() if k not in logged}
        if new:  # params are immutable: a resumed run logs only what it has not logged yet
            mlflow.log_params(new)
        yield run


def resume_state(work: Path, identity: dict) -> str | None:
    """The MLflow run id of an unfinished stage in `work`, if its parameters match `identity`.

    Resumable stages (filter, grpo) call this before starting their run and `save_resume_state` once it
    exists, so a rerun after a crash continues the same run instead of scattering the work over two."""
    state = work / "resume_state.json"
    if not state.exists():
        return None
    saved = json.loads(state.read_text(encoding="utf-8"))
    if saved["identity"] != json.loads(json.dumps(identity, default=str)):
        raise SlmsqlError(f"{work} holds an unfinished run with other parameters; delete it to start over")
    return saved["run_id"]


def save_resume_state(work: Path, identity: dict, run_id: str) -> None:
    write_json(work / "resume_state.json", {"identity": identity, "run_id": run_id}, default=str)


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


def trainer_callback():
    """A transformers callback logging the trainer's metrics to the active MLflow run, and nothing else:
    `report_to="mlflow"` would also log ~224 params (every training argument and model-config field)."""
    from transformers import TrainerCallback

    class MlflowMetrics(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            import mlflow

            if state.is_world_process_zero and logs:
                mlflow.log_metrics({metric_name(k): v for k, v in numeric(logs).items()}, step=state.global_step)

    return MlflowMetrics()


def server_command(host: str, port: int, store: Path, artifacts: Path) -> list[str]:
    """A real `mlflow server` on loopback with served artifacts, and without the job runner (which would
    start 7 more workers and ~2 GB for features slmsql does not use)."""
    import sys

    return [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port),
            "--backend-store-uri", f"sqlite:///{Path(store).resolve()}",
            "--serve-artifacts", "--artifacts-destination", str(Path(artifacts).resolve()), "--workers", "1"]


def start_server(host="127.0.0.1", port=5000, store="mlflow-server.db", artifacts="mlartifacts",
                 timeout_s: float = 60, log_file=None):
    """Start the server, wait until /health answers, return (process, uri). `port=0` picks a free port."""
    import socket
    import subprocess
    import time

    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]

    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen(server_command(host, port, Path(store), Path(artifacts)), env=env,
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


KEY_METRICS = {"toy": ("sft_total", "dev_total", "dev_cross_total"), "tiny-model": ("parameters",),
               "sft": ("train_loss", "steps"), "filter": ("band", "all_fail", "all_pass", "out_of_band", "errors"),
               "grpo": ("summary/frac_reward_zero_std", "summary/reward_std",
                        "summary/exec_frac_groups_correctness_varies", "steps"),
               "evaluate": ("ex", "ex_ci_low", "ex_ci_high", "vs_baseline_diff", "vs_baseline_mcnemar_p"),
               "publish": (), "validate": ("n_failed",), "pipeline": ("grpo_ex_dev", "grpo_ex_dev_cross")}


def runs_table(experiment: str = "slmsql", limit: int = 20) -> str:
    """The latest runs, one line each, with the metrics that matter for their stage."""
    import mlflow

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
        for k in KEY_METRICS.get(stage, ()):
            if k in r.data.metrics:
                v = r.data.metrics[k]
                shown.append(f"{k.split('/')[-1]}={v:.3g}")
        if "slmsql.verdict" in r.data.tags:
            shown.append(r.data.tags["slmsql.verdict"])
        lines.append(f"{(r.info.run_name or '')[:20]:<20} {stage:<10} {r.info.status:<9} {r.info.run_id:<32}  "
                     + " ".join(shown))
    return "\n".join(lines)


def quiet_progress(trainer) -> None:
    """Keep the trainer's progress bar but stop it printing every log dict to stdout (MLflow has them)."""
    from transformers.trainer_callback import ProgressCallback

    class BarOnly(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            pass

    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(BarOnly())
