"""MLflow set-up shared by every stage: where runs go, failing fast, and what never gets logged."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from slmsql.errors import SlmsqlError
from slmsql.inputs.data import write_json
from slmsql.runtime import distributed

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
    that artifact's run URI (`param_value`). `system_metrics`: MLflow's sampler takes CPU, memory (and GPU
    where pynvml is installed) every 10 s as `system/*` metrics, and once more at the run's end, so every such run
    has them however short it was; for the long training and sampling stages (with an outbox, through it:
    system_metrics_sampler).

    Launched as several processes, the main process alone starts and logs the run; the others get a stand-in
    holding the run's id and must log nothing (an MLflow call there would start a second run). The run records
    the world size and the launcher.

    `outbox` (a durable.Outbox; the training stages): what the stage logs through it once the run has started,
    and the run's end, reach the server in order even across an outage (tracking/durable.py); what an earlier attempt
    left in it is sent first. Starting the run still needs the server: it fails at once when it does not answer."""
    import types

    import mlflow

    from slmsql.configs import to_params

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
            set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.experiment)
        nested = mlflow.active_run() is not None
        with mlflow.start_run(run_id=run_id, run_name=None if run_id else (cfg.run_name or stage),
                              nested=nested, log_system_metrics=False,  # our sampler instead (system_metrics_sampler)
                              tags=None if run_id else source_tags(f"slmsql {stage}")) as run:
            if not run_id:
                drop_local_remote(run)
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
                sampler = None
                if system_metrics:
                    sampler = system_metrics_sampler(None, run.info.run_id, resume=run_id is not None)
                    sampler.start()
                try:
                    yield run
                finally:
                    if sampler is not None:
                        sampler.finish()  # its last sample, before the run ends
                return
            outbox.start(run.info.run_id, system_metrics=system_metrics, resume=run_id is not None)
            try:
                yield run
            except BaseException:
                outbox.end_run("FAILED")
                raise
            outbox.end_run("FINISHED")


def system_metrics_sampler(outbox, run_id: str, resume: bool):
    """MLflow's system-metrics sampler (every MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL s, 10 by default), its
    samples logged through `outbox` (a durable.Outbox) and nothing asked of the server after it starts (its
    `monitor` loop, less the server call at every sample; mlflow 3.17.2, pinned); without an outbox, straight to
    the run (MLflow's own batch logger). `resume`: step on from the run's last `system/*` step.

    Every run gets `system/*`, however short: at `finish` the samples since the last one published (the one at
    the interval's start, and one more taken then) are published, where MLflow's own loop drops them. A run's
    metric names must not depend on how long it ran: a sweep's cells are compared side by side by name, and a
    test of a short run would otherwise see `system/*` on one machine and not on a faster one."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    class ToOutbox:  # what the sampler's publish_metrics and finish call on MLflow's batch logger
        data = ()

        def record_metrics(self, metrics, step):
            outbox.log_metrics(metrics, step)

        def flush(self):
            pass

    class Sampler(SystemMetricsMonitor):
        def monitor(self):
            while True:  # at least one sample, even when the run ends before the loop starts
                for _ in range(self.samples_before_logging):
                    self.collect_metrics()
                    if self._shutdown_event.wait(self.sampling_interval):
                        self.collect_metrics()  # CPU %: the share since the sample before, up to the end
                        self.publish_metrics(self.aggregate_metrics())
                        return
                self.publish_metrics(self.aggregate_metrics())

    sampler = Sampler(run_id, resume_logging=resume)
    if outbox is not None:
        sampler.mlflow_logger = ToOutbox()
    return sampler


def set_experiment(name: str):
    """mlflow.set_experiment, less its export of MLFLOW_EXPERIMENT_ID to this process's environment: an id of this
    store, which every process started later would inherit (a `mlflow run` or a stage in another store then
    refuses it, or logs to the wrong experiment). This process keeps the experiment as its active one."""
    import mlflow

    before = os.environ.get("MLFLOW_EXPERIMENT_ID")
    try:
        return mlflow.set_experiment(name)
    finally:
        if before is None:
            os.environ.pop("MLFLOW_EXPERIMENT_ID", None)
        else:
            os.environ["MLFLOW_EXPERIMENT_ID"] = before


# --- where a run came from, without a folder of this machine ---------------------------------------------------
def source_tags(name: str) -> dict:
    """`mlflow.source.name` for a run slmsql starts: the command (`slmsql grpo`), or for a workflow's step the
    project (`project_source`). MLflow's own is the script that started the process (sys.argv[0]: a path of this
    machine) or the project's folder; tags given when the run starts win over MLflow's (fluent.start_run)."""
    from mlflow.utils.mlflow_tags import MLFLOW_SOURCE_NAME

    return {MLFLOW_SOURCE_NAME: name}


def git_remote(folder) -> str | None:
    """The git remote of the clone holding `folder` when it is a network URL (https://, ssh, git@host:...);
    None when there is none or it is a folder (a clone of a local clone), which names nothing elsewhere."""
    from mlflow.utils.git_utils import get_git_repo_url

    url = get_git_repo_url(str(folder))
    return None if not url or _local_url(url) else url


def _local_url(url: str) -> bool:
    return url.startswith("file:") or os.path.isabs(url) or ("://" not in url and ":" not in url)


def project_source(folder) -> str:
    """A workflow step's `mlflow.source.name`: the project's git remote (the UI links a GitHub one), else its
    name as MLproject gives it."""
    return git_remote(folder) or "slmsql"


def drop_local_remote(run) -> None:
    """MLflow tags a run started in a clone with its remote (`mlflow.source.git.repoURL`): removed when that is
    a folder of this machine."""
    import mlflow
    from mlflow.utils.mlflow_tags import MLFLOW_GIT_REPO_URL

    url = run.data.tags.get(MLFLOW_GIT_REPO_URL)
    if url and _local_url(url):
        mlflow.MlflowClient().delete_tag(run.info.run_id, MLFLOW_GIT_REPO_URL)


def provenance_tag(model: str | list[str]) -> dict:
    """`slmsql.model_provenance` for a model whose files say where they came from (hub.provenance: e.g. weights
    dequantized from a GGUF, not the Hub repo's own), so every run and the card say so. A list (a sweep's starts):
    each start's that has one, once."""
    from slmsql.inputs.sources import provenance

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


def portable_config(cfg) -> dict:
    """A stage's config as a file kept with its output (the adapter's slmsql_grpo_config.json, which publish
    pushes to the Hub): every path `portable`, and without the fields that say only where and how it ran
    (configs.RUN_ONLY: its output folder among them)."""
    import dataclasses

    from slmsql.configs import RUN_ONLY

    def one(v):
        return [one(x) for x in v] if isinstance(v, list) else portable(v) if isinstance(v, str) and v else v

    return {k: one(v) for k, v in dataclasses.asdict(cfg).items() if k not in RUN_ONLY}


def renamed(obj, names: dict):
    """`obj` (JSON) with each local path in `names` replaced, wherever a string holds it, by its name there
    (`{"/abs/out/filter": "runs:/<id>"}`): a report of local files as the run that keeps them names them."""
    if isinstance(obj, dict):
        return {k: renamed(v, names) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [renamed(v, names) for v in obj]
    if isinstance(obj, str):
        for local, name in sorted(names.items(), key=lambda kv: -len(kv[0])):  # the longest, most specific first
            obj = obj.replace(local, name)
    return obj


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


STAT_DIGITS = 6  # significant digits of an evaluation's statistics as metrics (`numeric`)


def numeric(metrics: dict, digits: int | None = None) -> dict:
    """Only the finite numbers: MLflow metrics refuse strings, and inf means 'not computable' here. `digits`:
    rounded to that many significant digits (statistics: the run page prints a metric as JavaScript writes the
    double, 0.29138894435599386 for a Wilson bound)."""
    import math

    return {k: float(v) if digits is None else float(f"{v:.{digits}g}") for k, v in metrics.items()
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
    """Start the server, wait until /health answers from the server's own process, return (process, uri).
    `port=0` picks a free port: the OS hands one out and the server binds it a moment later, so another process
    may take it in between; then the server is stopped and started again on another port (up to 4 times), and
    never is someone else's server on that port taken for it. `store` is a SQLite file or a backend store URI
    (e.g. postgresql://user:pw@host:port/db)."""
    import socket
    import subprocess

    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    attempts = 4 if port == 0 else 1
    for attempt in range(attempts):
        chosen = port
        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                chosen = s.getsockname()[1]
        proc = subprocess.Popen(server_command(host, chosen, store, Path(artifacts)), env=env,
                                stdout=log_file or subprocess.DEVNULL, stderr=subprocess.STDOUT)
        uri = f"http://{host}:{chosen}"
        outcome = _wait_healthy(proc, chosen, uri, timeout_s)
        if outcome == "up":
            return proc, uri
        _stop_tree(proc)
        if outcome == "taken" and attempt + 1 < attempts:
            continue
        if outcome == "timeout":
            raise SlmsqlError(f"mlflow server on {uri} did not become healthy within {timeout_s:.0f} s")
        raise SlmsqlError(f"mlflow server could not listen on port {chosen}: another process has it"
                          if outcome == "taken" else
                          f"mlflow server exited with code {proc.returncode} (port {chosen} in use?)")


def _wait_healthy(proc, port: int, uri: str, timeout_s: float) -> str:
    """'up' (/health answers and the port listens in the server's own process tree), 'taken' (another process
    listens on the port), 'exited' or 'timeout'."""
    import time

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:  # it could not bind: taken if something else listens there
            import socket
            from urllib.parse import urlsplit

            with socket.socket() as s:
                s.settimeout(2)
                return "taken" if s.connect_ex((urlsplit(uri).hostname, port)) == 0 else "exited"
        try:
            with urllib.request.urlopen(uri + "/health", timeout=2):
                pass
        except OSError:
            time.sleep(0.5)
            continue
        if _listens(proc.pid, port):
            return "up"
        if proc.poll() is None:  # someone else answered: ours cannot bind, or will fail to
            return "taken"
    return "timeout"


def _tree(pid: int) -> list:
    import psutil

    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _listens(pid: int, port: int) -> bool:
    """Whether `port` listens in process `pid` or one of its children (uvicorn's worker)."""
    import psutil

    for p in _tree(pid):
        with contextlib.suppress(psutil.Error):
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in p.net_connections(kind="tcp")):
                return True
    return False


def _stop_tree(proc) -> None:
    import psutil

    for p in reversed(_tree(proc.pid)):
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(Exception):
        proc.wait(timeout=30)


def runs_table(experiment: str = "slmsql", limit: int = 20) -> str:
    """The latest runs, one line each, with the metrics that matter for their stage."""
    import mlflow

    from slmsql.configs import STAGES

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

    from slmsql.inputs.data import safe_text

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


# The MLflow UI (3.17) opens an experiment by a per-browser switch, not by anything the experiment holds: its
# sidebar's "GenAI | Model training" toggle (`workflowType`: the link's `?workflowType=`, else what the browser
# last chose, else GenAI). GenAI lands on Overview/Traces, Model training on "Training runs". The experiment kind
# tag is read only where that switch is disabled (it is enabled in 3.17's build): set for such UIs, it changes
# nothing here. The runs table then shows a saved view (the UI's own JSON state in an experiment tag) only when
# asked: `?viewStateShareKey=` in the link `ui_link` prints, or the view picked by name from the table's views
# menu (3.17 lists a view whose tag holds its "envelope": name, times, state). Both are UI conventions, not API:
# a UI that ignores them shows its defaults, nothing breaks.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
VIEW_KEY = "slmsql"
RESULT = "slmsql.result"  # a run's result in one cell (wording): an evaluation's, the pipeline's headline, the
# filter's band, GRPO's learning signal, SFT's loss
# Tags only: a metric column's cell in a group row is MLflow's aggregate of the group, "- (max)" where the group's
# runs lack the metric (an eval set's group and the training runs' signal), and a tag cell there stays empty
VIEW_COLUMNS = ("tags.`slmsql.stage`", f"tags.`{RESULT}`")
RUN_NAME_COLUMN = "attributes.`Run Name`"  # the UI's id of its run-name column, which holds the group labels


GROUP_BY = "slmsql.dataset"  # an evaluation's eval set; on a pipeline run, the eval sets of its headline
# The UI's id of the group of runs without the grouping tag (training runs, sweep parents): "<mode>.<tag>"
# (mlflow/server/js, experiment page row utils). It always comes last; opened, it shows the training runs' signal.
UNGROUPED = f"tag.{GROUP_BY}"


def runs_view() -> dict:
    """slmsql's runs-table view: runs grouped by eval set (tag `slmsql.dataset`: each SFT/GRPO pair side by side),
    in the order they started, so a pipeline's headline (its run starts first and carries the eval sets it
    sums up) is the first group and each pair reads baseline then GRPO; the runs without an eval set last, open.
    Each run's result is a formatted tag (VIEW_COLUMNS: no metric column). The run-name column is wide enough for
    a group's label (`Group: toy-dev_cross`). Charts draw each run (its name in the legend), not each group: the
    UI names the group of runs without an eval set "Additional runs" in the table but "Unassigned" in charts.
    (The UI does not take pinned runs from a saved view, so order is the only way to put the headline first.)"""
    return {"selectedColumns": list(VIEW_COLUMNS), "columnOrder": [RUN_NAME_COLUMN, *VIEW_COLUMNS],
            "runsHiddenMode": "SHOW_ALL", "useGroupedValuesInCharts": False,
            "columnWidths": {RUN_NAME_COLUMN: 280, f"tags.`{RESULT}`": 420, "tags.`slmsql.stage`": 90},
            "orderByKey": "attributes.start_time", "orderByAsc": True, "groupsExpanded": {UNGROUPED: True},
            "groupBy": {"aggregateFunction": "max", "groupByKeys": [{"mode": "tag", "groupByData": GROUP_BY}]}}


def view_tag() -> tuple[str, str]:
    """slmsql's view as the experiment tag the UI reads: the runs-table state in the envelope of a named saved
    view (`name`, `createdAt`, `updatedAt` in ms, `state`), so the views menu lists it as "slmsql" and the link
    opens it (the UI reads an envelope first, a bare state second)."""
    import json
    import time

    now = int(time.time() * 1000)
    return f"mlflow.sharedViewState.{VIEW_KEY}", json.dumps({"name": VIEW_KEY, "createdAt": now, "updatedAt": now,
                                                             "state": json.dumps(runs_view())})


def save_view(experiment_id: str, client=None) -> None:
    """Write slmsql's view, replacing an older one: the view `ui_link` opens is slmsql's own (a user's views are
    saved under their own names)."""
    import mlflow

    (client or mlflow.MlflowClient()).set_experiment_tag(experiment_id, *view_tag())


def describe_experiment(experiment_id: str) -> None:
    """Give the experiment a description, its kind and the runs-table view `ui_link` opens, each unless it has
    one (a user's own is kept)."""
    import mlflow

    client = mlflow.MlflowClient()
    have = client.get_experiment(experiment_id).tags
    for key, value in ((NOTE, EXPERIMENT_NOTE), EXPERIMENT_KIND, view_tag()):
        if key not in have:
            client.set_experiment_tag(experiment_id, key, value)


def ui_link(experiment_id: str, uri: str | None = None) -> str:
    """The experiment's runs table in the MLflow UI, in its model-training mode, with slmsql's columns."""
    base = (uri or os.environ.get("MLFLOW_TRACKING_URI", ""))
    base = base.rstrip("/") if base.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"
