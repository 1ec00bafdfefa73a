"""Tracking that survives an outage: what a training stage logs once its run has started goes through an
outbox on local disk, so a tracking server that goes away (a restart, a deploy, an OOM kill) costs the run
nothing it measured, and training never waits for it.

Each record (a step's metrics with their step and time, a tag, a table, an artifact, a LoggedModel's files
and final status, the run's end) is appended to `<folder>/records.jsonl`, the files it names linked or copied under
`<folder>/files/`, before anything is sent. A thread sends the records in order, noting in `<folder>/sent` how
many are done with; while the server does not answer it retries with backoff and the records wait on disk.
When the stage ends it waits up to SLMSQL_TRACKING_WAIT_S for the outbox to empty (then deletes it); if it
cannot, the stage fails (non-zero) and the records stay for `slmsql sync-tracking <folder>`. Credentials the
server turns away (401, 403: an expired token) are not a record's fault: the sender waits and retries as in an
outage, and the records stay in order. A record the server refuses (another 4xx: retrying it as it is cannot
help) is set aside with the server's reason in `<folder>.refused.jsonl`, beside the outbox, the file it names
moved to `<folder>.refused/` (no file a record names is deleted while that record is unsent), and the records
after it go on; `slmsql sync-tracking <folder>` shows what was set aside, and with `--resend-refused` sends it
again once the cause is fixed (a deleted run restored, a limit raised).

System metrics (`system/*`: CPU, memory, disk, network, GPU) are sampled by MLflow's sampler and logged through
the outbox too: MLflow's own asks the server at every sample whether the run still runs and quits for good at
its first failed call, so `system/*` would stop at an outage for the rest of the run.

Once: a record whose answer was lost (stored by the server, timed out here) is sent again, so every record is
idempotent at the server: metrics go with their original step and timestamp (the store keeps one point per
key, step, timestamp and value), tags, tables and artifacts write the same value or file again, a LoggedModel's
status and the end set the same status (and end time). MLflow's own log_table appends to an existing table, so
tables are written as files here instead. On a file store (file:./mlruns) a metric point sent twice is
stored twice (that store appends without looking): there the one record in flight when a stage or
`sync-tracking` was killed can leave its points doubled; the SQLite store, and a server over it, keep one.

Why not MLflow's: its async logging queues metrics, params and tags in memory and drops a batch the server
refuses (no artifacts, nothing kept on disk); its HTTP retries (MLFLOW_HTTP_REQUEST_MAX_RETRIES) block the
training loop for each call and give up after a few minutes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

from slmsql.errors import SlmsqlError

log = logging.getLogger(__name__)
WAIT_ENV = "SLMSQL_TRACKING_WAIT_S"
DEFAULT_WAIT_S = 300.0  # a server restart or deploy takes less; a GPU job should not hold its machine longer
RETRY_S = (0.5, 10.0)  # backoff between attempts while the server does not answer: first, longest


def folder_for(output_dir) -> Path:
    """A stage's outbox: `<output_dir>.outbox`, beside the output folder (it outlives a failed stage)."""
    out = Path(output_dir).resolve()
    return out.with_name(out.name + ".outbox")


def wait_s() -> float:
    raw = os.environ.get(WAIT_ENV, "")
    try:
        return float(raw) if raw else DEFAULT_WAIT_S
    except ValueError:
        raise SlmsqlError(f"{WAIT_ENV}={raw!r} is not a number of seconds") from None


def sync_command(folder) -> str:
    return f"slmsql sync-tracking {folder}"


def refused_file(folder) -> Path:
    """Where the records the server refused are set aside: `<outbox>.refused.jsonl`, beside the outbox (it
    outlives the outbox, which is deleted once every record has gone or been set aside)."""
    folder = Path(folder)
    return folder.with_name(folder.name + ".refused.jsonl")


def refused_dir(folder) -> Path:
    """Where the files of set-aside records are kept (`<outbox>.refused/`), until they are sent."""
    folder = Path(folder)
    return folder.with_name(folder.name + ".refused")


class Refused(Exception):
    """The server answered and refused a record: retrying it as it is will not help."""


class Unauthorized(Exception):
    """The server turned this process's credentials away (HTTP 401 or 403): no fault of the record. Kept and
    retried, as in an outage, until the credentials are fixed."""


AUTH = (401, 403)
FIX_CREDENTIALS = ("fix the credentials (MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and "
                   "MLFLOW_TRACKING_PASSWORD, or ~/.mlflow/credentials)")


class Outbox:
    """`with Outbox(folder_for(out)) as box:` around the stage's output folder and run; `stage_run(...,
    outbox=box)` starts it on the run and ends the run through it. Only the main process of a launch starts it;
    elsewhere it stays idle. On exit it waits (bounded) until everything is sent; if not, a stage that succeeded
    fails with a message naming the folder and the command that sends it."""

    def __init__(self, folder, wait: float | None = None):
        self.folder = Path(folder)
        self.wait = wait_s() if wait is None else wait
        self.run_id: str | None = None
        self._cond = threading.Condition()
        self._records: list[dict] = []
        self._sent = 0
        self._stop = False
        self._error: Exception | None = None  # the last failure, while the server does not answer
        self._thread: threading.Thread | None = None
        self._models: list[str] = []  # LoggedModels finalized with the run's end (track_model)
        self._refused = 0  # records the server refused, set aside (set_aside)
        self._monitor = None  # the system-metrics sampler (tracking.system_metrics_sampler), when asked for

    def send_earlier(self) -> None:
        """Send what an earlier attempt left in this folder (a crash, a server that stayed away), before this
        attempt's run starts: a resumed run's earlier end must not arrive after it restarts."""
        if (self.folder / "meta.json").is_file():
            n, _ = sync(self.folder)
            log.info("sent %d tracking record(s) an earlier attempt left in %s", n, self.folder)

    # --- the stage's side: append a record; never waits for the server ------------------------------------
    def start(self, run_id: str, background: bool = True, system_metrics: bool = False,
              resume: bool = False) -> None:
        """Start sending. `system_metrics`: sample them into the outbox (module docstring), continuing the
        run's `system/*` steps when `resume`."""
        import mlflow

        self.run_id = run_id
        if not (self.folder / "meta.json").is_file():
            # what is here was all sent: an outbox is deleted only once empty, meta.json with it (a deletion a
            # crash cut short leaves the rest; a `sent` count left alone would skip as many new records)
            shutil.rmtree(self.folder, ignore_errors=True)
        (self.folder / "files").mkdir(parents=True, exist_ok=True)
        # where the records go (`sync` reads it); a folder an earlier attempt left was emptied by send_earlier
        (self.folder / "meta.json").write_text(json.dumps({"tracking_uri": mlflow.get_tracking_uri()}),
                                               encoding="utf-8")
        self._records, self._sent = load(self.folder)
        if background:
            self._thread = threading.Thread(target=self._send_loop, name="slmsql-outbox", daemon=True)
            self._thread.start()
        if system_metrics:
            from slmsql.tracking.runs import system_metrics_sampler

            self._monitor = system_metrics_sampler(self, run_id, resume)
            self._monitor.start()

    def log_metrics(self, metrics: dict, step: int = 0) -> None:
        self._append({"kind": "metrics", "metrics": {k: float(v) for k, v in metrics.items()}, "step": int(step),
                      "time": int(time.time() * 1000)})

    def set_tag(self, key: str, value) -> None:
        self._append({"kind": "tag", "key": key, "value": str(value)})

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        self._append({"kind": "artifact", "artifact_path": artifact_path}, source=Path(path))

    def log_artifacts(self, folder, artifact_path: str | None = None) -> None:
        self._append({"kind": "artifacts", "artifact_path": artifact_path}, source=Path(folder))

    def log_model_artifact(self, model_id: str, path, artifact_path: str | None = None) -> None:
        """A file or folder into a LoggedModel's own artifacts (a policy's adapter: tracking/lineage.py)."""
        self._append({"kind": "model_artifact", "model_id": model_id, "artifact_path": artifact_path},
                     source=Path(path))

    def log_figure(self, figure, artifact_file: str) -> None:
        self._append({"kind": "artifact", "artifact_path": _parent(artifact_file)},
                     write=lambda p: figure.savefig(p), name=Path(artifact_file).name)

    def log_table(self, table, artifact_file: str) -> None:
        """A pandas DataFrame as MLflow's table artifact (the JSON log_table writes), replaced, not appended."""
        data = table.to_dict(orient="split")
        self._append({"kind": "table", "artifact_file": artifact_file}, name=Path(artifact_file).name,
                     write=lambda p: p.write_text(json.dumps(data, indent=2, default=str), encoding="utf-8"))

    def track_model(self, model_id: str) -> None:
        """A LoggedModel (lineage.start_policy_model) this run makes: the run's end finalizes it, READY when the
        run finished, else FAILED, through the outbox like the rest."""
        self._models.append(model_id)

    def end_run(self, status: str) -> None:
        """The run's end goes last into the outbox; here the run ends without asking the server."""
        self._stop_monitor()  # its last sample before the end
        for model_id in self._models:  # after the files it names, before the end
            self._append({"kind": "model", "model_id": model_id,
                          "status": "READY" if status == "FINISHED" else "FAILED"})
        self._append({"kind": "end", "status": status, "time": int(time.time() * 1000)})
        end_locally(self.run_id)

    def _stop_monitor(self) -> None:
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None

    def _append(self, record: dict, source: Path | None = None, write=None, name: str | None = None) -> None:
        from slmsql.runtime.outputs import link_or_copy

        with self._cond:
            n = len(self._records)
            record = {"n": n, "run": self.run_id, **record}
            if source is not None or write is not None:
                dst = self.folder / "files" / f"{n:06d}" / (name or source.name)
                dst.parent.mkdir(parents=True, exist_ok=True)
                if write is not None:
                    write(dst)
                elif source.is_dir():  # hard links where possible: a full model's weights are not copied
                    shutil.copytree(source, dst, copy_function=link_or_copy)
                else:
                    link_or_copy(source, dst)
                record["file"] = dst.relative_to(self.folder).as_posix()
            with open(self.folder / "records.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())  # on disk before the stage goes on: a crash loses nothing acknowledged
            self._records.append(record)
            self._cond.notify_all()

    # --- the sender ---------------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        client = _client(self.folder)
        delay = RETRY_S[0]
        while True:
            with self._cond:
                while not self._stop and self._sent >= len(self._records):
                    self._cond.wait()
                if self._stop and (self._sent >= len(self._records) or self._error is not None):
                    return
                record = self._records[self._sent]
            try:
                send(client, self.folder, record)
            except Refused as e:
                set_aside(self.folder, record, e)
                self._refused += 1
            except Exception as e:  # no answer, or our credentials turned away: keep the records, try again later
                if type(e) is not type(self._error) and isinstance(e, Unauthorized):
                    log.warning("%s; training goes on, its records are kept in %s and sent once the server takes "
                                "them: %s", e, self.folder, FIX_CREDENTIALS)
                elif self._error is None:
                    log.warning("MLflow tracking server does not answer (%s); training goes on, its records are "
                                "kept in %s until it does", _short(e), self.folder)
                self._error = e
                with self._cond:
                    self._cond.wait_for(lambda: self._stop, timeout=delay)
                delay = min(2 * delay, RETRY_S[1])
                continue
            with self._cond:
                self._sent += 1
                _write_sent(self.folder, self._sent)
                self._cond.notify_all()
            if self._error is not None:
                log.info("MLflow tracking server answers again: sending the kept records")
            self._error, delay = None, RETRY_S[0]

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.run_id is None:  # never started (not the main process, or the run never began)
            return
        self._stop_monitor()
        deadline = time.monotonic() + self.wait
        with self._cond:
            self._cond.wait_for(lambda: self._sent >= len(self._records)
                                or self._thread is None or not self._thread.is_alive(),
                                timeout=max(0.0, deadline - time.monotonic()))
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()  # at most one request's MLFLOW_HTTP_REQUEST_TIMEOUT, or the rest if it answers
        left = len(self._records) - self._sent
        if self._refused:
            log.error("%d tracking record(s) of run %s were refused by the server, set aside in %s; `%s` shows "
                      "them with the server's reasons (and `--resend-refused` sends them again once the cause is "
                      "fixed)", self._refused, self.run_id, refused_file(self.folder), sync_command(self.folder))
        if left == 0:
            shutil.rmtree(self.folder, ignore_errors=True)
            return
        once = (f"once you {FIX_CREDENTIALS}" if isinstance(self._error, Unauthorized) else
                "once the server answers")
        message = (f"{left} tracking record(s) of run {self.run_id} were not sent "
                   f"({_short(self._error) if self._error else 'the server did not answer'}; waited "
                   f"{self.wait:.0f} s, {WAIT_ENV}): the run stays RUNNING in the store until they are. They are "
                   f"kept in {self.folder}; {once}, send them with: {sync_command(self.folder)}")
        if exc_type is None:
            raise SlmsqlError(message)
        log.error(message)  # the stage's own error is the one raised


# --- records on disk, and sending them -------------------------------------------------------------------
def load(folder: Path) -> tuple[list[dict], int]:
    """The records, and how many were sent. A last line cut short by a crash was never acknowledged: dropped."""
    records = []
    path = folder / "records.jsonl"
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    sent = folder / "sent"
    return records, int(sent.read_text()) if sent.exists() else 0


def _write_sent(folder: Path, n: int) -> None:
    tmp = folder / "sent.tmp"
    tmp.write_text(str(n))
    os.replace(tmp, folder / "sent")  # lost on a crash: those records are sent again, which is harmless


def _parent(artifact_file: str) -> str | None:
    return str(Path(artifact_file).parent) if "/" in artifact_file else None


def _short(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _uri(folder: Path) -> str:
    """Where an outbox's records go: MLFLOW_TRACKING_URI when set (as everywhere), else the store recorded
    when it was made."""
    return os.environ.get("MLFLOW_TRACKING_URI") or \
        json.loads((folder / "meta.json").read_text(encoding="utf-8"))["tracking_uri"]


def _client(folder: Path):
    import mlflow

    return mlflow.MlflowClient(_uri(folder))


def send(client, folder: Path, record: dict) -> None:
    """One record to the server, idempotently (module docstring). Raises Refused when the server refused it."""
    from mlflow.entities import Metric
    from mlflow.exceptions import MlflowException
    from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

    run, kind = record["run"], record["kind"]
    file = str(folder / record["file"]) if "file" in record else None
    try:
        if kind == "metrics":
            client.log_batch(run, metrics=[Metric(k, v, record["time"], record["step"])
                                           for k, v in record["metrics"].items()])
        elif kind == "tag":
            client.set_tag(run, record["key"], record["value"])
        elif kind == "artifact":
            client.log_artifact(run, file, record["artifact_path"])
        elif kind == "artifacts":
            client.log_artifacts(run, file, record["artifact_path"])
        elif kind == "table":
            client.log_artifact(run, file, _parent(record["artifact_file"]))
            # the tag by which the UI lists a run's tables, as MLflow's log_table sets it
            tables = json.loads(client.get_run(run).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
            entry = {"path": record["artifact_file"], "type": "table"}
            if entry not in tables:
                client.set_tag(run, MLFLOW_LOGGED_ARTIFACTS, json.dumps(tables + [entry]))
        elif kind == "model_artifact" and Path(file).is_dir():
            folder = "/".join(filter(None, (record["artifact_path"], Path(file).name)))
            client.log_model_artifacts(record["model_id"], file, folder)
        elif kind == "model_artifact":
            client.log_model_artifact(record["model_id"], file, record["artifact_path"])
        elif kind == "model":
            client.finalize_logged_model(record["model_id"], record["status"])
        elif kind == "end":
            client.set_terminated(run, record["status"], end_time=record["time"])
        else:
            raise Refused(f"unknown record kind {kind!r}")
    except MlflowException as e:
        status = e.get_http_status_code()
        if status in AUTH:
            raise Unauthorized(f"the MLflow tracking server refused this process's credentials (HTTP {status}: "
                               f"{_short(e)})") from e
        if 400 <= status < 500 and status not in (408, 429):
            raise Refused(f"record {record['n']} ({kind}): {_short(e)}") from e
        raise
    except FileNotFoundError as e:
        raise Refused(f"record {record['n']} ({kind}): {e}") from e
    except Exception as e:  # an artifact upload's HTTP error (requests), 401 or 403 among them
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in AUTH:
            raise Unauthorized(f"the MLflow tracking server refused this process's credentials (HTTP {status}: "
                               f"{_short(e)})") from e
        raise


def sync(folder) -> tuple[int, str]:
    """Send what an outbox still holds, in order (`slmsql sync-tracking`); delete it once empty. Returns the
    number of records the server took (those it refused are set aside: `refused`) and where they went."""
    from slmsql.tracking import runs as tracking

    folder = Path(folder)
    if not (folder / "meta.json").is_file():
        raise SlmsqlError(f"{folder} is not a tracking outbox (no meta.json)")
    records, sent = load(folder)
    os.environ["MLFLOW_TRACKING_URI"] = _uri(folder)
    uri = tracking.configure()  # fails at once, and clearly, while the server is still away
    client = _client(folder)
    took = 0
    for i in range(sent, len(records)):
        try:
            send(client, folder, records[i])
            took += 1
        except Refused as e:
            set_aside(folder, records[i], e)
        except Exception as e:
            fix = f"; {FIX_CREDENTIALS}, then" if isinstance(e, Unauthorized) else ","
            raise SlmsqlError(f"{folder}: record {i} of {len(records)} not sent ({_short(e)}); "
                              f"{len(records) - i} left{fix} run this again") from None
        _write_sent(folder, i + 1)
    shutil.rmtree(folder)
    return took, uri


def set_aside(folder: Path, record: dict, reason: Exception) -> None:
    """Keep a record the server refused, with its reason and the store it was for, in `refused_file`, and the file
    it names in `refused_dir` (the outbox that held it is deleted once the rest is sent); the sender goes on."""
    log.error("the tracking server refused %s of run %s; set aside in %s", reason, record["run"],
              refused_file(folder))
    if "file" in record and (folder / record["file"]).exists():
        kept = refused_dir(folder) / record["file"]
        kept.parent.mkdir(parents=True, exist_ok=True)
        os.replace(folder / record["file"], kept)
    entry = {"reason": str(reason), "record": record, "tracking_uri": _uri(folder)}
    with open(refused_file(folder), "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _set_aside_entries(folder) -> list[dict]:
    path = refused_file(folder)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def refused(folder) -> list[str]:
    """The records set aside from outbox `folder`, one line each: what, of which run, and the server's reason."""
    return [f"run {e['record']['run']}: {e['reason']}" for e in _set_aside_entries(folder)]


def resend_refused(folder) -> tuple[int, int]:
    """Send the records set aside from outbox `folder` again, in order (`slmsql sync-tracking --resend-refused`,
    once their cause is fixed), to MLFLOW_TRACKING_URI when set, else the store each was for. Those refused again
    stay set aside with the new reason; the rest, and their files, are removed. Returns (sent, still set aside)."""
    import mlflow

    from slmsql.tracking import runs as tracking

    entries, kept, took = _set_aside_entries(folder), [], 0
    files, given, clients = refused_dir(folder), os.environ.get("MLFLOW_TRACKING_URI"), {}
    for i, e in enumerate(entries):
        uri = given or e["tracking_uri"]
        if uri not in clients:
            os.environ["MLFLOW_TRACKING_URI"] = uri
            tracking.configure()  # fails at once, and clearly, while the server is away
            clients[uri] = mlflow.MlflowClient(uri)
        try:
            send(clients[uri], files, e["record"])
            took += 1
            if "file" in e["record"]:
                shutil.rmtree(files / Path(e["record"]["file"]).parent, ignore_errors=True)
        except Refused as again:
            kept.append({**e, "reason": str(again)})
        except Exception as err:
            _rewrite_set_aside(folder, kept + entries[i:])
            fix = f"; {FIX_CREDENTIALS}, then" if isinstance(err, Unauthorized) else ","
            raise SlmsqlError(f"{refused_file(folder)}: set-aside record {i + 1} of {len(entries)} not sent "
                              f"({_short(err)}); {len(entries) - i} left set aside{fix} run this again") from None
    _rewrite_set_aside(folder, kept)
    return took, len(kept)


def _rewrite_set_aside(folder, entries: list[dict]) -> None:
    path = refused_file(folder)
    if not entries:
        path.unlink(missing_ok=True)
        shutil.rmtree(refused_dir(folder), ignore_errors=True)
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(e) + "\n" for e in entries), encoding="utf-8")
    os.replace(tmp, path)


def end_locally(run_id: str) -> None:
    """End MLflow's active run here without telling the server (its end is in the outbox): drop it from the
    active-run stack and stop its system-metrics sampler. mlflow.end_run() does both, then asks the server to
    end the run, which would fail, or come before the records it waits on. MLflow has no public call for the
    first part: this reads two of its module globals (mlflow 3.17.2, pinned; the outage test covers it)."""
    from mlflow.tracking import fluent

    stack = fluent._active_run_stack.get()
    stack[:] = [r for r in stack if r.info.run_id != run_id]
    os.environ.pop("MLFLOW_RUN_ID", None)  # as end_run does
    monitor = fluent.run_id_to_system_metrics_monitor.pop(run_id, None)
    if monitor is not None:
        monitor.finish()
