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
from .wording import pct, pts, pval

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
              system_metrics: bool = False):
    """Start (or, under `mlflow run` or on resume, reuse) the run for one stage, with its config as params.

    Params: empty options are left out, and the local copy of a run artifact (`fetch_inputs`) is logged as
    that artifact's run URI (`param_value`). `system_metrics`: MLflow samples CPU, memory (and GPU
    where pynvml is installed) every 10 s as `system/*` metrics; for the long training and sampling stages.

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
                              nested=nested, log_system_metrics=system_metrics) as run:
            describe_experiment(run.info.experiment_id)
            tags = {k: v for k, v in (tags or {}).items() if v not in ("", None)}  # an empty option: no tag
            mlflow.set_tags({"slmsql.stage": stage, "slmsql.world_size": str(distributed.world_size()),
                             "slmsql.launcher": distributed.launcher(), **tags})
            logged = mlflow.get_run(run.info.run_id).data.params
            new = {k: param_value(v)[:6000] for k, v in params.items() if k not in logged and str(v) != ""}
            if new:  # params are immutable: a resumed run logs only what it has not logged yet
                mlflow.log_params(new)
            send(run.info.run_id)
            yield run


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


def log_dataset(rows: list[dict], name: str, source, context: str) -> None:
    """Log `rows` as an MLflow dataset input of the active run. `name` is what the data is (`sft`, `rl`, the
    eval set's name): one name per dataset, whichever run logs it. Its source is the file, or the run URI it
    was fetched from (`param_value`)."""
    import warnings

    import mlflow
    import pandas as pd
    from mlflow.data.dataset_source_registry import resolve_dataset_source

    from .data import safe_text

    with warnings.catch_warnings():  # "can be interpreted in multiple ways": two local-file resolvers
        warnings.simplefilter("ignore")
        src = resolve_dataset_source(str(source))
    uri = param_value(source)
    if uri != str(source):
        src = type(src)(uri)
    mlflow.log_input(mlflow.data.from_pandas(pd.DataFrame(safe_text(rows)), source=src, name=name), context=context)


# --- the metric vocabulary: every metric name a run logs, in one place -------------------------------------
# (name, runs that log it, meaning). A `<placeholder>` stands for any of the values in PLACEHOLDERS. README's
# "Metric vocabulary" table is `vocabulary_markdown()` (a test keeps them equal, and tests fail when a stage
# logs a name that is not here).
OUTCOME_STATUSES = ("correct", "wrong_result", "error", "timeout", "truncated", "rejected", "no_sql", "missing",
                    "gold_error")
TRL_NAMES = ("loss", "grad_norm", "learning_rate", "epoch", "entropy", "num_tokens", "mean_token_accuracy", "kl",
             "aux_loss", "policy_loss", "entropy_coef", "cispo_clip_ratio", "step_time", "train_runtime",
             "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss")
TRL_PREFIXES = ("completions", "rewards", "clip_ratio", "sampling", "tools", "profiling", "vespo")
SUMMARY_OF = ("reward", "reward_std", "frac_reward_zero_std", "grad_norm", "exec/correct",
              "exec/frac_groups_correctness_varies", "completions/mean_length", "entropy", "step_time",
              "dynamic_sampling/groups_dropped", "dynamic_sampling/extra_rounds")
PLACEHOLDERS = {
    "<difficulty>": "simple|moderate|challenging",
    "<status>": "|".join(OUTCOME_STATUSES),
    "<i>": r"\d+", "<k>": r"\d+",
    "<split>": "sft|rl_source|dev|dev_cross",
    "<count>": "total|simple|moderate|challenging",
    "<metric>": "|".join(map(re.escape, SUMMARY_OF)),
    "<trl metric>": "|".join(TRL_NAMES) + "|(?:" + "|".join(TRL_PREFIXES) + r")/[\w./-]+",
    "<system metric>": r"[\w./-]+",
    "<step>": r"[\w-]+",
    "<step metric>": r"[\w./-]+",
    "<ds metric>": "groups_sampled|groups_kept|groups_dropped|groups_filled|extra_rounds",
}
VOCABULARY = [
    ("ex", ("evaluate",), "execution accuracy: share of questions whose predicted SQL returns the gold result"),
    ("ex_ci_low", ("evaluate",), "lower bound of the 95% Wilson interval of `ex`"),
    ("ex_ci_high", ("evaluate",), "upper bound of the 95% Wilson interval of `ex`"),
    ("n", ("evaluate",), "questions scored"),
    ("n_correct", ("evaluate",), "questions answered right"),
    ("ex_<difficulty>", ("evaluate",), "`ex` on the questions of one difficulty (simple, moderate, challenging)"),
    ("n_<difficulty>", ("evaluate",), "questions of that difficulty"),
    ("exec/<status>", ("evaluate", "grpo"),
     "share of answers with this outcome: correct, wrong_result (ran, other rows), error, timeout, truncated, "
     "rejected (by the sandbox), no_sql, missing (no prediction), gold_error; per question (evaluate), per sampled "
     "completion at each step (grpo). Tables name outcomes the same way (`status`)"),
    ("baseline/ex", ("evaluate",), "`ex` of the baseline run (`--baseline-run`) on the same questions"),
    ("baseline/ex_ci_low", ("evaluate",), "lower bound of the baseline's Wilson interval at confidence 1 − α"),
    ("baseline/ex_ci_high", ("evaluate",), "upper bound of the baseline's Wilson interval at confidence 1 − α"),
    ("vs_baseline/diff", ("evaluate",), "`ex` minus `baseline/ex` (this run minus the baseline)"),
    ("vs_baseline/diff_ci_low", ("evaluate",),
     "lower bound of the difference's exact interval at 1 − α (excludes 0 exactly when `vs_baseline/p` < α)"),
    ("vs_baseline/diff_ci_high", ("evaluate",), "upper bound of that interval"),
    ("vs_baseline/p", ("evaluate",), "McNemar's exact two-sided p on the questions the two runs disagree on"),
    ("vs_baseline/mdd", ("evaluate",), "smallest difference the test detects with 80% power at this n"),
    ("vs_baseline/only_this_right", ("evaluate",), "questions this run got right and the baseline wrong"),
    ("vs_baseline/only_baseline_right", ("evaluate",), "questions the baseline got right and this run wrong"),
    ("vs_baseline/both_right", ("evaluate",), "questions both runs got right"),
    ("vs_baseline/both_wrong", ("evaluate",), "questions both runs got wrong"),
    ("n_source", ("filter",), "source questions sampled"),
    ("band", ("filter",), "questions with low < pass rate < high: the RL data"),
    ("all_fail", ("filter",), "questions no sample answered right (0/K)"),
    ("all_pass", ("filter",), "questions every sample answered right (K/K)"),
    ("out_of_band", ("filter",), "questions with another pass rate (neither band, 0/K nor K/K)"),
    ("out_of_band_<i>_of_<k>", ("filter",), "questions with pass rate exactly i/K outside the band"),
    ("errors", ("filter",), "questions that could not be sampled: missing database, or gold SQL that fails"),
    ("data_check_success", ("filter",), "1 when the rl data check passed on the filter's own output"),
    ("reward", ("grpo",), "mean total reward per sampled completion (TRL)"),
    ("reward_std", ("grpo",), "reward standard deviation within a prompt's group (TRL)"),
    ("frac_reward_zero_std", ("grpo",), "share of groups whose completions all got one reward: no gradient (TRL)"),
    ("exec/frac_groups_correctness_varies", ("grpo",),
     "share of groups holding both right and wrong SQL: the signal about correctness"),
    ("dynamic_sampling/<ds metric>", ("grpo",),
     "`--dynamic-sampling`, per step: groups sampled, kept (correctness varies), dropped, filled back in, and "
     "the extra generation rounds it took"),
    ("advantage_gate/frac_groups_zeroed", ("grpo",),
     "`--advantage-gate correctness`: share of groups whose advantages were zeroed (no correctness variance)"),
    ("summary/<metric>", ("grpo",), "mean over the run's logged steps of `<metric>` (e.g. `summary/reward_std`, "
                                    "`summary/exec/frac_groups_correctness_varies`)"),
    ("<trl metric>", ("sft", "grpo"),
     "TRL's and transformers' own training metrics under their names: loss, grad_norm, learning_rate, epoch, "
     "entropy, num_tokens, mean_token_accuracy (sft), kl (beta > 0), train_runtime, train_loss, ...; and "
     "`completions/*`, `rewards/<reward>/mean` and `/std`, `clip_ratio/*`, `sampling/*`"),
    ("steps", ("sft", "grpo"), "optimizer steps taken"),
    ("train_seconds", ("sft", "grpo"), "wall-clock training time"),
    ("train_loss", ("sft",), "mean training loss over the run"),
    ("examples", ("sft",), "training examples"),
    ("system/<system metric>", ("sft", "grpo", "filter"),
     "MLflow's system metrics, every 10 s: CPU, memory, disk, network, and GPU where pynvml is installed"),
    ("<split>_<count>", ("toy",), "questions per split (sft, rl_source, dev, dev_cross), total and per difficulty"),
    ("generate_seconds", ("toy",), "time to generate the toy world"),
    ("parameters", ("tiny-model",), "model parameters"),
    ("vocab_size", ("tiny-model",), "tokenizer vocabulary size"),
    ("texts", ("tiny-model",), "texts the tokenizer was trained on"),
    ("build_seconds", ("tiny-model",), "time to build the model"),
    ("n_expectations", ("validate",), "expectations checked"),
    ("n_failed", ("validate",), "expectations that failed"),
    ("success", ("validate",), "1 when every expectation passed"),
    ("n_rows", ("validate",), "rows validated"),
    ("gx_seconds", ("validate",), "Great Expectations validation time"),
    ("hub_new_commit", ("publish",), "1 when the push made a new Hub commit (0: the same files were there)"),
    ("variants", ("sweep",), "GRPO variants in the grid"),
    ("cells", ("sweep",), "variant x seed cells run or reused"),
    ("cells_reused", ("sweep",), "cells whose runs were reused (same parameters and code version)"),
    ("<step>/<step metric>", ("pipeline",),
     "a step's metric, under the step's run name: `filter/band`, `grpo/summary/reward_std`, `eval-sft-dev/ex`, "
     "`eval-grpo-dev/ex`, `eval-grpo-dev/vs_baseline/diff`, `eval-grpo-dev/vs_baseline/p`, ..."),
]
PIPELINE_STEPS = {"toy": "toy", "tiny-model": "tiny-model", "sft": "sft", "filter": "filter", "grpo": "grpo",
                  "publish": "publish", "eval-": "evaluate"}  # step run name (or its prefix) -> stage


def _pattern(name: str) -> str:
    out = re.escape(name)
    for ph, rx in PLACEHOLDERS.items():
        out = out.replace(re.escape(ph), f"(?:{rx})")
    return out


def documented(name: str, stage: str | None = None) -> bool:
    """Whether metric `name` is in the vocabulary (for `stage`, when given). A pipeline metric
    `<step>/<metric>` must be a documented metric of that step's stage."""
    for entry, stages, _ in VOCABULARY:
        if stage is not None and stage not in stages:
            continue
        if entry == "<step>/<step metric>":
            step, _, rest = name.partition("/")
            kind = next((k for p, k in PIPELINE_STEPS.items() if step == p or (p.endswith("-") and
                                                                               step.startswith(p))), None)
            if kind and rest and documented(rest, kind):
                return True
        elif re.fullmatch(_pattern(entry), name):
            return True
    return False


def vocabulary_markdown() -> str:
    """The README's metric table, generated from VOCABULARY."""
    lines = ["| metric | meaning | runs |", "|---|---|---|"]
    for name, stages, meaning in VOCABULARY:
        lines.append(f"| `{name}` | {meaning.replace('|', '/')} | {', '.join(stages)} |")
    return "\n".join(lines) + "\n"


def comparison_metrics(comparison: dict) -> dict:
    """An evaluation's paired comparison (`stats.compare`: side a is this run, b the baseline) as metrics
    named for the sides. This run's own EX and interval are `ex`, `ex_ci_*`: not logged twice."""
    names = {"ex_b": "baseline/ex", "ex_b_ci_low": "baseline/ex_ci_low", "ex_b_ci_high": "baseline/ex_ci_high",
             "diff": "vs_baseline/diff", "diff_ci_low": "vs_baseline/diff_ci_low",
             "diff_ci_high": "vs_baseline/diff_ci_high", "mcnemar_p": "vs_baseline/p", "mdd": "vs_baseline/mdd",
             "only_a": "vs_baseline/only_this_right", "only_b": "vs_baseline/only_baseline_right",
             "both_right": "vs_baseline/both_right", "both_wrong": "vs_baseline/both_wrong"}
    return numeric({new: comparison[old] for old, new in names.items() if old in comparison})


# --- descriptions: what the run found, in words and numbers, on its overview page --------------------------
NOTE = "mlflow.note.content"  # MLflow's description tag (runs and experiments)
EXPERIMENT_NOTE = (
    "slmsql: one run per stage (toy, tiny-model, sft, filter, grpo, evaluate, publish, validate), under a "
    "`pipeline` or `sweep` parent for those commands. Each run's description states its result. Compare evaluation "
    "runs on `ex` and `vs_baseline/*` (this run minus its baseline run; verdict in the tag `slmsql.verdict`); "
    "GRPO runs on `summary/frac_reward_zero_std` and `summary/exec/frac_groups_correctness_varies` (was there "
    "signal?). Metric names: README, \"Metric vocabulary\".")


def _duration(seconds) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


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
VIEW_COLUMNS = ("attributes.`Dataset`", "tags.`slmsql.stage`", "tags.`slmsql.verdict`", "metrics.`ex`",
                "metrics.`vs_baseline/diff`", "metrics.`vs_baseline/p`", "metrics.`band`",
                "metrics.`summary/exec/frac_groups_correctness_varies`", "metrics.`summary/frac_reward_zero_std`")


def runs_view() -> dict:
    """slmsql's runs-table view: runs grouped by stage (a pipeline's steps are shown, not folded under it),
    with the columns that state each stage's result."""
    return {"selectedColumns": list(VIEW_COLUMNS), "columnOrder": list(VIEW_COLUMNS), "runsHiddenMode": "SHOW_ALL",
            "columnWidths": {"tags.`slmsql.verdict`": 190},
            "groupBy": {"aggregateFunction": "average",
                        "groupByKeys": [{"mode": "tag", "groupByData": "slmsql.stage"}]}}


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


def evaluation_note(metrics: dict, dataset: str, match: str, comparison: dict | None = None,
                    baseline_name: str = "", alpha: float = 0.05) -> str:
    # no "[a, b] (" anywhere: the UI renders descriptions as Markdown, where that reads as a link
    text = (f"EX {pct(metrics['ex'])} (95% Wilson interval {pct(metrics['ex_ci_low'])} to "
            f"{pct(metrics['ex_ci_high'])}) on {metrics['n']} questions of {dataset}, {match} match.")
    if comparison:
        c = comparison
        text += (f"\nvs {baseline_name or 'the baseline'}: {pct(c['ex_b'])} → {pct(c['ex_a'])}, "
                 f"{pts(c['diff'])} points ({1 - alpha:.0%} interval {pts(c['diff_ci_low'])} to "
                 f"{pts(c['diff_ci_high'])}), McNemar p = {pval(c['mcnemar_p'])}: {c['verdict']} at α = {alpha:g}. "
                 f"{c['only_a']} questions only this run got right, {c['only_b']} only the baseline.")
    return text


def filter_note(summary: dict) -> str:
    b, k = summary["buckets"], summary["k"]
    oob = sum(b["out_of_band"].values())
    rates = ", ".join(f"{r}: {n}" for r, n in b["out_of_band"].items())
    return (f"Pass rates of {summary['n_source']} questions from K = {k} samples each: band "
            f"({summary['low']} < p < {summary['high']}) {b['band']}, all fail (0/{k}) {b['all_fail']}, "
            f"all pass ({k}/{k}) {b['all_pass']}, out of band {oob}{f' ({rates})' if rates else ''}, "
            f"errors {b['errors']}.\nGRPO trains on the {b['band']} band questions.")


def grpo_note(summary: dict) -> str:
    """Whether there was a learning signal: zero-variance groups give no gradient, and only groups with both
    right and wrong SQL say anything about correctness."""
    s = lambda k: summary.get(f"summary/{k}")  # noqa: E731
    varies, zero = s("exec/frac_groups_correctness_varies"), s("frac_reward_zero_std")
    if varies is None:
        verdict = "Signal unknown: the run logged no execution telemetry."
    elif varies == 0:
        verdict = "No correctness signal: no group held both right and wrong SQL."
    else:
        verdict = f"Correctness signal in {varies:.0%} of prompt groups (mean over steps)."
    facts = [f"{zero:.0%} of groups had zero reward variance (no gradient)" if zero is not None else None,
             f"reward {s('reward'):.3g}, reward std {s('reward_std'):.3g}" if s("reward") is not None
             and s("reward_std") is not None else None,
             f"{s('exec/correct'):.0%} of sampled completions correct" if s("exec/correct") is not None else None]
    return (f"GRPO, {summary.get('steps', 0):.0f} steps in {_duration(summary.get('train_seconds', 0))}. {verdict}\n"
            + "; ".join(f for f in facts if f) + ".")


def sft_note(summary: dict, model: str) -> str:
    kind = "LoRA adapter" if summary["kind"] == "adapter" else "full fine-tune"
    return (f"SFT ({kind}) of {param_value(model)}: {summary['steps']} steps on {summary['examples']} "
            f"examples in {_duration(summary['train_seconds'])}; train loss {summary['train_loss']:.3g}.")


def toy_note(summary: dict) -> str:
    counts = ", ".join(f"{c['total']} {split}" for split, c in summary["counts"].items())
    dbs = {db for names in summary.get("databases", {}).values() for db in names}  # split -> its databases
    return f"Toy world ({summary['size']}, seed {summary['seed']}): {counts} questions over {len(dbs)} databases."


def tiny_model_note(info: dict, cfg) -> str:
    return (f"Tiny Qwen2 model: {info['parameters']:,} parameters ({cfg.layers} layers, hidden {cfg.hidden}), "
            f"BPE vocabulary {info['vocab_size']:,} trained on {info['texts']:,} toy texts.")


def validate_note(report) -> str:
    head = (f"{report.kind} data check PASSED: all {len(report.results)} expectations" if report.success else
            f"{report.kind} data check FAILED: {len(report.failed)} of {len(report.results)} expectations "
            f"({', '.join(r['expectation'] for r in report.failed[:3])}{', ...' if len(report.failed) > 3 else ''})")
    return f"{head} on {report.n_rows} rows of {Path(report.data).name}."


def publish_note(cfg, result: dict) -> str:
    where = (f"pushed to {result['hub_url']} (commit {result['hub_commit'][:10]}"
             f"{'' if result.get('new_commit') else ', no change'})" if "hub_url" in result
             else "written, not pushed (dry run)")
    reg = (f"; registered as {result['registered_model']} version {result['model_version']}"
           if "model_version" in result else "")
    return (f"Model card for {cfg.repo_id} {where}{reg}. From GRPO run {cfg.grpo_run} and "
            f"{len(cfg.eval_runs)} evaluation run(s).")


def pipeline_note(headline: dict, verdicts: dict) -> str:
    """The lifecycle's headline from the pipeline's metrics (`<step>/<metric>`) and each eval set's verdict."""
    h = headline.get
    lines = [f"{split}: SFT {pct(h(f'eval-sft-{split}/ex'))} → GRPO {pct(h(f'eval-grpo-{split}/ex'))}, "
             f"{pts(h(f'eval-grpo-{split}/vs_baseline/diff'))} points "
             f"(interval {pts(h(f'eval-grpo-{split}/vs_baseline/diff_ci_low'))} to "
             f"{pts(h(f'eval-grpo-{split}/vs_baseline/diff_ci_high'))}, "
             f"McNemar p = {pval(h(f'eval-grpo-{split}/vs_baseline/p'))}): {verdict}."
             for split, verdict in verdicts.items()]
    varies, zero = h("grpo/summary/exec/frac_groups_correctness_varies"), h("grpo/summary/frac_reward_zero_std")
    tail = (f"Filter: {h('filter/band', 0):.0f} band questions of {h('filter/n_source', 0):.0f}"
            + (f"; GRPO: correctness varied in {varies:.0%} of groups" if varies is not None else "")
            + (f", {zero:.0%} had zero reward variance" if zero is not None else "") + ".")
    return "SFT → GRPO on the toy world. " + " ".join(lines) + "\n" + tail


def sweep_note(rep: dict) -> str:
    """The sweep's table in words: each variant on each eval set, pooled over its seeds, Holm-adjusted."""
    rows = "; ".join(f"{r['variant']} on {r['eval_set']}: {pct(r['ex_b'])} → {pct(r['ex_mean'])} (mean over "
                     f"seeds), {pts(r['diff'])} points (interval {pts(r['diff_ci_low'])} to "
                     f"{pts(r['diff_ci_high'])}), p (Holm) = {pval(r['p_holm'])}: {r['verdict']}" for r in rep["rows"])
    return (f"Sweep: {len(rep['variants'])} variant(s) x {len(rep['seeds'])} seed(s) vs the starting policy, "
            f"pooled per variant, Holm over {rep['comparisons']} comparisons.\n{rows}.")


def log_headline(headline: dict, verdicts: dict) -> None:
    """On the pipeline's parent run: the headline as metrics, each eval set's verdict as a tag
    (`slmsql.verdict.<set>`, and all of them in `slmsql.verdict`), and the description."""
    import mlflow

    mlflow.log_metrics(numeric(headline))
    mlflow.set_tags({"slmsql.verdict": ", ".join(f"{k}: {v}" for k, v in verdicts.items()),
                     **{f"slmsql.verdict.{k}": v for k, v in verdicts.items()}})
    describe(pipeline_note(headline, verdicts))
