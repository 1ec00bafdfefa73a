"""MLflow set-up shared by every stage: where runs go, failing fast, and what never gets logged."""

from __future__ import annotations

import contextlib
import os
import re
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
def stage_run(stage: str, cfg, params: dict | None = None, tags: dict | None = None, run_id: str | None = None,
              system_metrics: bool = False, outbox=None):
    """Start (or, under `mlflow run` or on resume, reuse) the run for one stage, with its config as params.

    Params: empty options are left out, and the local copy of a run artifact (`fetch_inputs`) is logged as
    that artifact's run URI (`param_value`). `system_metrics`: MLflow samples CPU, memory (and GPU
    where pynvml is installed) every 10 s as `system/*` metrics; for the long training and sampling stages.

    Launched as several processes, the main process alone starts and logs the run; the others get a stand-in
    holding the run's id and must log nothing (an MLflow call there would start a second run). The run records
    the world size and the launcher.

    `outbox` (a durable.Outbox; the training stages): what the stage logs through it once the run has started,
    and the run's end, reach the server in order even across an outage (durable.py); what an earlier attempt
    left in it is sent first. Starting the run still needs the server: it fails at once when it does not answer."""
    import types

    import mlflow

    from .configs import to_params

    params = {**to_params(cfg), **(params or {})}
    if not distributed.is_main():
        yield types.SimpleNamespace(info=types.SimpleNamespace(run_id=distributed.receive()))
        return
    with distributed.sending() as send:
        configure()
        if outbox is not None:
            outbox.send_earlier()
        run_id = run_id or os.environ.get("MLFLOW_RUN_ID")
        if not run_id:
            mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.experiment)
        nested = mlflow.active_run() is not None
        with mlflow.start_run(run_id=run_id, run_name=None if run_id else (cfg.run_name or stage),
                              nested=nested, log_system_metrics=system_metrics) as run:
            describe_experiment(run.info.experiment_id)
            tags = {**provenance_tag(getattr(cfg, "model", "")), **(tags or {})}
            tags = {k: v for k, v in tags.items() if v not in ("", None)}  # an empty option: no tag
            mlflow.set_tags({"slmsql.stage": stage, "slmsql.world_size": str(distributed.world_size()),
                             "slmsql.launcher": distributed.launcher(), **tags})
            logged = mlflow.get_run(run.info.run_id).data.params
            new = {k: param_value(v)[:6000] for k, v in params.items() if k not in logged and str(v) != ""}
            if new:  # params are immutable: a resumed run logs only what it has not logged yet
                mlflow.log_params(new)
            send(run.info.run_id)
            if outbox is None:
                yield run
                return
            outbox.start(run.info.run_id)
            try:
                yield run
            except BaseException:
                outbox.end_run("FAILED")
                raise
            outbox.end_run("FINISHED")


def provenance_tag(model: str | list[str]) -> dict:
    """`slmsql.model_provenance` for a model whose files say where they came from (hub.provenance: e.g. weights
    dequantized from a GGUF, not the Hub repo's own), so every run and the card say so. A list (a sweep's starts):
    each start's that has one, once."""
    from .hub import provenance

    said = []
    for one in model if isinstance(model, (list, tuple)) else [model]:
        record = provenance(one) if one else None
        text = "; ".join(str(record[k]) for k in ("note", "source") if record.get(k)) if record else ""
        if text and text not in said:
            said.append(text)
    return {"slmsql.model_provenance": " | ".join(said)} if said else {}


# --- inputs by run URI: params hold `runs:/<id>/<path>`, stages read a local copy --------------------------
FROM_RUNS = "from-runs"  # run `<id>`'s artifact `<path>` is fetched to `<output_dir>/../from-runs/<id>/<path>`
RUN_URI = re.compile(r"runs:/([0-9a-f]{32})(?:/(.*))?")


def artifact_cache(root, run_id: str) -> Path:
    """Where artifacts fetched from run `run_id` are kept (`param_value` maps them back to their URI)."""
    return Path(root) / FROM_RUNS / run_id


def param_value(value) -> str:
    """A param as logged: a path inside an `artifact_cache` folder is the run URI it was fetched from
    (`runs:/<id>/policy`), the same on every machine; anything else as given. The pipeline matches reusable
    steps by comparing these values."""
    text = str(value)
    m = re.search(rf"(?:^|/){FROM_RUNS}/([0-9a-f]{{32}})(?:/(.*))?$", text.replace(os.sep, "/"))
    return f"runs:/{m[1]}/{m[2] or ''}".rstrip("/") if m else text


def portable(value) -> str:
    """A model or folder as a tag names it, the same on every machine: a fetched run artifact as its run URI
    (`param_value`), a path inside the working folder relative to it; anything else (a Hub id) as given."""
    text = param_value(value)
    if text and os.path.isabs(text) and Path(text).is_relative_to(Path.cwd()):
        return str(Path(text).relative_to(Path.cwd()))
    return text


def fetch(uri: str, root) -> str:
    """The local copy of a run artifact `runs:/<id>/<path>` under `artifact_cache(root, id)`, downloaded once
    (into a temporary folder, then moved into place: an interrupted download is never taken for a copy; a lock
    makes the processes of a multi-process launch, which all fetch, download it once)."""
    import fcntl
    import shutil

    m = RUN_URI.fullmatch(uri.rstrip("/"))
    if not m or not m[2]:
        raise SlmsqlError(f"{uri!r} is not a run artifact URI (runs:/<32-hex run id>/<artifact path>)")
    cache = artifact_cache(Path(root).resolve(), m[1])
    dst = cache / m[2]
    fetched = [p for p in (dst, *dst.parents) if p != cache and cache in p.parents]  # it, or a folder above it
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dst.exists() and any((p.parent / f".{p.name}.fetched").exists() for p in fetched):
            return str(dst)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            got = download(m[1], m[2], tmp)
            dst.parent.mkdir(parents=True, exist_ok=True)
            if dst.exists():  # an older, unmarked copy: replaced
                shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
            os.replace(got, dst)
        (dst.parent / f".{dst.name}.fetched").touch()
    return str(dst)


def fetch_inputs(cfg):
    """`cfg` with each option given as `runs:/<id>/<path>` replaced by its local copy, fetched next to the
    output folder (`<output_dir>/../from-runs/`). The run's params keep the URI (`param_value`)."""
    import dataclasses

    def is_uri(v):
        return isinstance(v, str) and v.startswith("runs:/")

    def local(v):
        return [local(x) for x in v] if isinstance(v, list) else \
            fetch(v, Path(cfg.output_dir).resolve().parent) if is_uri(v) else v

    names = [f.name for f in dataclasses.fields(cfg)
             if is_uri(getattr(cfg, f.name)) or (isinstance(getattr(cfg, f.name), list)
                                                 and any(map(is_uri, getattr(cfg, f.name))))]
    if not names:
        return cfg
    configure()  # the store the URIs refer to
    return dataclasses.replace(cfg, **{k: local(getattr(cfg, k)) for k in names})


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
                shown.append(f"{k}={v:.3g}")
        if "slmsql.verdict" in r.data.tags:
            shown.append(r.data.tags["slmsql.verdict"])
        lines.append(f"{(r.info.run_name or '')[:20]:<20} {stage:<10} {r.info.status:<9} {r.info.run_id:<32}  "
                     + " ".join(shown))
    return "\n".join(lines)


def log_dataset(rows: list[dict], name: str, source, context: str, uri: str | None = None):
    """Log `rows` as an MLflow dataset input of the active run, and return it (metrics name it: `dataset=`).
    `name` is what the data is (`sft`, `rl`, the eval set's name): one name per dataset, whichever run logs it.
    Its source is the file, or the run URI it was fetched from (`param_value`), or `uri` (a run artifact it is
    logged as: the store keeps one source per dataset, which every run that logs it shows)."""
    import warnings

    import mlflow
    import pandas as pd
    from mlflow.data.dataset_source_registry import resolve_dataset_source

    from .data import safe_text

    with warnings.catch_warnings():  # "can be interpreted in multiple ways": two local-file resolvers
        warnings.simplefilter("ignore")
        src = resolve_dataset_source(str(source))
    uri = uri or param_value(source)
    if uri != str(source):
        src = type(src)(uri)
    dataset = mlflow.data.from_pandas(pd.DataFrame(safe_text(rows)), source=src, name=name)
    mlflow.log_input(dataset, context=context)
    return dataset


# --- descriptions: what the run found, in words and numbers, on its overview page --------------------------
NOTE = "mlflow.note.content"  # MLflow's description tag (runs and experiments)
EXPERIMENT_NOTE = (
    "slmsql: one run per stage (toy, tiny-model, sft, filter, grpo, evaluate, publish, validate), under a "
    "`pipeline` or `sweep` parent for those commands. Each run's description states its result. Compare evaluation "
    "runs on `ex` and `vs_baseline/*` (this run minus its baseline run; verdict in the tag `slmsql.verdict`); "
    "GRPO runs on `summary/frac_reward_zero_std` and `summary/exec/frac_groups_correctness_varies` (was there "
    "signal?). Metric names: docs/vocabulary.md.")


def describe(text: str, run_id: str | None = None) -> str:
    """Set a run's description (the active run's by default); returns the text."""
    import mlflow

    if run_id:
        mlflow.MlflowClient().set_tag(run_id, NOTE, text)
    else:
        mlflow.set_tag(NOTE, text)
    return text


# The MLflow UI (3.x) opens an experiment in its GenAI mode with no metric columns in the runs table. Two
# experiment tags the UI reads change that: the experiment kind, and a saved view of the runs table ("shared
# view": the UI's own JSON state, selected by `?viewStateShareKey=` in the link `ui_link` prints). Both are UI
# conventions, not API: a UI that ignores them shows its defaults, nothing breaks.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
VIEW_KEY = "slmsql"
RESULT = "slmsql.result"  # an evaluation's result in one cell (wording.result); the pipeline's headline
VIEW_COLUMNS = ("tags.`slmsql.stage`", f"tags.`{RESULT}`", "metrics.`band`",
                "metrics.`summary/exec/frac_groups_correctness_varies`", "metrics.`summary/frac_reward_zero_std`")


GROUP_BY = "slmsql.dataset"  # an evaluation's eval set; on a pipeline run, the eval sets of its headline
# The UI's id of the group of runs without the grouping tag (training runs, sweep parents): "<mode>.<tag>"
# (mlflow/server/js, experiment page row utils). It always comes last; opened, it shows the training runs' signal.
UNGROUPED = f"tag.{GROUP_BY}"


def runs_view() -> dict:
    """slmsql's runs-table view: runs grouped by eval set (tag `slmsql.dataset`: each SFT/GRPO pair side by side),
    in the order they started, so a pipeline's headline (its run starts first and carries the eval sets it
    sums up) is the first group and each pair reads baseline then GRPO; the runs without an eval set last, open.
    Each run's result is a formatted tag, beside the training runs' signal metrics. No evaluation metric column:
    a group row would average SFT and GRPO into a number that means nothing. (The UI does not take pinned runs
    from a saved view, so order is the only way to put the headline first.)"""
    return {"selectedColumns": list(VIEW_COLUMNS), "columnOrder": list(VIEW_COLUMNS), "runsHiddenMode": "SHOW_ALL",
            "columnWidths": {f"tags.`{RESULT}`": 420, "tags.`slmsql.stage`": 90},
            "orderByKey": "attributes.start_time", "orderByAsc": True, "groupsExpanded": {UNGROUPED: True},
            "groupBy": {"aggregateFunction": "max", "groupByKeys": [{"mode": "tag", "groupByData": GROUP_BY}]}}


def save_view(experiment_id: str, client=None) -> None:
    """Write slmsql's view, replacing an older one: the view `ui_link` opens is slmsql's own (a user's views are
    saved under their own names)."""
    import json

    import mlflow

    (client or mlflow.MlflowClient()).set_experiment_tag(experiment_id, f"mlflow.sharedViewState.{VIEW_KEY}",
                                                         json.dumps(runs_view()))


def describe_experiment(experiment_id: str) -> None:
    """Give the experiment a description, its kind and the runs-table view `ui_link` opens, each unless it has
    one (a user's own is kept)."""
    import json

    import mlflow

    client = mlflow.MlflowClient()
    have = client.get_experiment(experiment_id).tags
    for key, value in ((NOTE, EXPERIMENT_NOTE), EXPERIMENT_KIND,
                       (f"mlflow.sharedViewState.{VIEW_KEY}", json.dumps(runs_view()))):
        if key not in have:
            client.set_experiment_tag(experiment_id, key, value)


def ui_link(experiment_id: str, uri: str | None = None) -> str:
    """The experiment's runs table in the MLflow UI, in its model-training mode, with slmsql's columns."""
    base = (uri or os.environ.get("MLFLOW_TRACKING_URI", ""))
    base = base.rstrip("/") if base.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"
