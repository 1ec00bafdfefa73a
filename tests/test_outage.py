"""Training survives a tracking outage (tracking/durable.py): a real `mlflow server` on loopback is SIGKILLed mid-run
and restarted on the same port and store; the run keeps training, ends FINISHED, and holds every step's
metrics exactly once. A server still away at the end: the stage fails with the adapter on disk, and
`slmsql sync-tracking` sends the rest later. The replay itself is idempotent (a record sent twice)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import mlflow
import pandas as pd
import psutil
import pytest
from click.testing import CliRunner
from ports import Front, start_serving
from policy import policy_fixture, read, tracking_store, write  # noqa: F401  (the fixture)
import watched

from slmsql import configs
from slmsql.tracking import durable, runs as tracking
from slmsql.training import hf_trainer as training
from slmsql.cli import main as cli
from slmsql.errors import SlmsqlError
from slmsql.stages import grpo, sft


# ---- the replay is idempotent: fast, on a SQLite store ------------------------------------------------------

def test_records_sent_twice_are_stored_once(tmp_path):
    """Every kind of record, sent, then sent again from a copy of the outbox whose `sent` count was lost (the
    server stored them, the answers never came back): one point per metric step, one table, the same end."""
    art = tmp_path / "weights.bin"
    art.write_bytes(b"\x00" * 64)
    table = pd.DataFrame({"question": ["a", "b"], "reward": [0.0, 1.0]})
    folder = tmp_path / "out.outbox"
    with mlflow.start_run() as run:
        box = durable.Outbox(folder, wait=0)
        box.start(run.info.run_id, background=False)
        for step in (1, 2, 3):
            box.log_metrics({"loss": 1.0 / step, "reward": step / 10}, step=step)
        box.log_table(table, "completions/step_00002.json")
        box.set_tag("slmsql.policy_kind", "adapter")
        box.log_artifact(art, "policy")
        box.log_metrics({"train_loss": 0.5})
        box.end_run("FINISHED")
    assert mlflow.active_run() is None  # ended here, without a word to the server
    run_id = run.info.run_id
    client = mlflow.MlflowClient()
    assert client.get_run(run_id).info.status == "RUNNING"  # the end is still in the outbox
    replay = tmp_path / "replay.outbox"
    shutil.copytree(folder, replay)
    n, _ = durable.sync(folder)
    assert n == 8 and not folder.exists()
    first = client.get_run(run_id)
    assert first.info.status == "FINISHED"
    n, _ = durable.sync(replay)  # everything again
    assert n == 8
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.end_time == first.info.end_time
    for key in ("loss", "reward"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [1, 2, 3], key
    assert [m.step for m in client.get_metric_history(run_id, "train_loss")] == [0]
    rows = json.loads(Path(client.download_artifacts(run_id, "completions/step_00002.json", str(tmp_path / "dl")))
                      .read_text())["data"]
    assert rows == [["a", 0.0], ["b", 1.0]]  # not appended to itself, as mlflow.log_table would
    assert json.loads(run.data.tags["mlflow.loggedArtifacts"]) == [
        {"path": "completions/step_00002.json", "type": "table"}]
    assert run.data.tags["slmsql.policy_kind"] == "adapter"
    assert [f.path for f in client.list_artifacts(run_id, "policy")] == ["policy/weights.bin"]


def test_what_an_earlier_attempt_left_goes_before_the_run_restarts(tmp_path):
    """A crash while the server was away left the run's FAILED end in the outbox; the resumed attempt sends it
    before restarting the run, so it cannot land after the restart and end the resumed run."""
    folder = tmp_path / "out.outbox"
    with mlflow.start_run() as run:
        box = durable.Outbox(folder, wait=0)
        box.start(run.info.run_id, background=False)
        box.log_metrics({"loss": 1.0}, step=1)
        box.end_run("FAILED")
    run_id, client = run.info.run_id, mlflow.MlflowClient()
    with durable.Outbox(folder, wait=watched.STALL_S) as box, \
            tracking.stage_run("sft", configs.load(configs.SFTStageConfig, None, {}), run_id=run_id, outbox=box):
        assert durable.load(folder)[0] == []  # a fresh outbox: the earlier records are already in the store
        assert client.get_run(run_id).info.status == "RUNNING"
        assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1]
        box.log_metrics({"loss": 0.5}, step=2)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [1, 2]
    assert not folder.exists()


def test_a_record_cut_short_by_a_crash_is_dropped(tmp_path):
    folder = tmp_path / "out.outbox"
    with mlflow.start_run() as run:
        box = durable.Outbox(folder, wait=0)
        box.start(run.info.run_id, background=False)
        box.log_metrics({"loss": 1.0}, step=1)
        with open(folder / "records.jsonl", "a") as f:
            f.write('{"n": 1, "run": "')  # the process died mid-append: that record was never acknowledged
    records, sent = durable.load(folder)
    assert [r["n"] for r in records] == [0] and sent == 0


def left_unsent(folder, records, status="FINISHED"):
    """An outbox holding `records` ((kind, payload) pairs) and the run's end, none sent (the server was away);
    returns the run's id. A tag keyed `bad!key` is one the server refuses: no '!' in a tag's name."""
    with mlflow.start_run() as run:
        box = durable.Outbox(folder, wait=0)
        box.start(run.info.run_id, background=False)
        for kind, payload in records:
            box.log_metrics(payload[0], step=payload[1]) if kind == "metrics" else box.set_tag(*payload)
        box.end_run(status)
    return run.info.run_id


REFUSED = [("metrics", ({"loss": 1.0}, 1)), ("tag", ("bad!key", "x")), ("metrics", ({"loss": 0.5}, 2))]


def test_a_refused_record_is_set_aside_and_blocks_no_later_stage(tmp_path):
    """A record the store refuses (a tag name it does not allow): set aside with the reason beside the outbox; the
    records after it are sent, and the next attempt, which sends what the earlier one left first, starts."""
    folder = tmp_path / "out.outbox"
    run_id = left_unsent(folder, REFUSED, "FAILED")
    client = mlflow.MlflowClient()
    with durable.Outbox(folder, wait=watched.STALL_S) as box, \
            tracking.stage_run("sft", configs.load(configs.SFTStageConfig, None, {}), run_id=run_id, outbox=box):
        assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2]
        box.log_metrics({"loss": 0.25}, step=3)
    assert client.get_run(run_id).info.status == "FINISHED" and not folder.exists()
    [aside] = durable.refused(folder)
    assert aside.startswith(f"run {run_id}: record 1 (tag): ") and "bad!key" in aside
    assert json.loads(durable.refused_file(folder).read_text())["record"]["key"] == "bad!key"


@pytest.mark.slow
def test_set_aside_records_keep_their_files_and_are_resent_once_the_cause_is_fixed(tmp_path):
    """The run was deleted meanwhile (a cleanup job): the store refuses its records, which are set aside, the
    table's file with them (the outbox is deleted once the rest is handled); the run restored, `slmsql
    sync-tracking --resend-refused` (a new process) sends them, in order, and clears what was set aside."""
    import subprocess
    import sys

    folder = tmp_path / "out.outbox"
    with mlflow.start_run() as run:
        box = durable.Outbox(folder, wait=0)
        box.start(run.info.run_id, background=False)
        box.log_metrics({"loss": 1.0}, step=1)
        box.log_table(pd.DataFrame({"question": ["a"], "reward": [1.0]}), "completions/step_00001.json")
        box.end_run("FINISHED")
    client = mlflow.MlflowClient()
    client.delete_run(run.info.run_id)
    n, _ = durable.sync(folder)
    assert n == 0 and not folder.exists() and len(durable.refused(folder)) == 3
    kept = list(durable.refused_dir(folder).rglob("step_00001.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["data"] == [["a", 1.0]]  # not deleted with the outbox

    sync = [sys.executable, "-m", "slmsql.cli", "sync-tracking", str(folder)]
    shown = watched.run(sync)
    assert shown.returncode == 0, shown.stderr
    assert "3 record(s) the tracking server refused" in shown.stdout and "--resend-refused" in shown.stdout
    still = watched.run(sync + ["--resend-refused"])
    assert still.returncode == 0 and "sent 0 set-aside tracking record(s) again; 3 refused again" in still.stdout
    assert kept[0].exists()  # refused again: kept again
    client.restore_run(run.info.run_id)
    fixed = watched.run(sync + ["--resend-refused"])
    assert fixed.returncode == 0, fixed.stderr
    assert "sent 3 set-aside tracking record(s) again; 0 refused again" in fixed.stdout
    assert "refused, set aside" not in fixed.stdout
    assert not durable.refused_file(folder).exists() and not durable.refused_dir(folder).exists()
    got = client.get_run(run.info.run_id)
    assert got.info.status == "FINISHED" and [m.step for m in client.get_metric_history(got.info.run_id, "loss")] == [1]
    assert json.loads(got.data.tags["mlflow.loggedArtifacts"]) == [{"path": "completions/step_00001.json",
                                                                   "type": "table"}]


def test_a_leftover_sent_count_cannot_swallow_new_records(tmp_path):
    """An outbox whose deletion a crash cut short can leave its `sent` count without its records; the next
    outbox in that folder starts afresh instead of counting its own first records as sent."""
    folder = tmp_path / "out.outbox"
    folder.mkdir()
    (folder / "sent").write_text("5")
    run_id = left_unsent(folder, [("metrics", ({"loss": 1.0}, 1)), ("metrics", ({"loss": 0.5}, 2))])
    n, _ = durable.sync(folder)
    assert n == 3
    client = mlflow.MlflowClient()
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2]


def test_wait_must_be_a_number(monkeypatch, tmp_path):
    monkeypatch.setenv(durable.WAIT_ENV, "soon")
    with pytest.raises(SlmsqlError, match="SLMSQL_TRACKING_WAIT_S='soon' is not a number"):
        durable.Outbox(tmp_path / "x.outbox")


def test_sync_refuses_a_folder_that_is_not_an_outbox(tmp_path):
    result = CliRunner().invoke(cli, ["sync-tracking", str(tmp_path)])
    assert result.exit_code == 2 and "is not a tracking outbox" in result.output


# ---- a real server, killed mid-run ----------------------------------------------------------------------

class Server:
    """`mlflow server` on one loopback address and store, which can be SIGKILLed (the whole process tree: the
    server and its uvicorn worker, as an OOM kill or a container stop does) and restarted. The address is a port
    this test holds throughout (ports.Front), so no other process can take it while the server is away; each start
    gets a port of its own behind it. While the server is away, a connection to the address is reset at once."""

    def __init__(self, root: Path):
        self.root, self.proc, self.backend = root, None, None
        self.front = Front()
        self.port = self.front.port
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self):
        def launch(port):
            with open(self.root / "server.log", "ab") as log:
                return subprocess.Popen(tracking.server_command("127.0.0.1", port, self.root / "store.db",
                                                                self.root / "artifacts"),
                                        env=server_env(), stdout=log, stderr=subprocess.STDOUT)

        def healthy(port):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return True

        self.proc, self.backend = start_serving(launch, healthy,
                                                describe=lambda: (self.root / "server.log").read_text())
        self.front.backend = self.backend

    def kill(self):
        if self.proc is None:
            return
        self.front.down()
        try:
            procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=watched.STALL_S)
        psutil.wait_procs(procs, timeout=watched.STALL_S)
        self.proc = None

    def close(self):
        self.kill()
        self.front.close()


def server_env() -> dict:
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)  # as tracking.start_server starts it
    return env


@pytest.fixture
def server(tmp_path):
    srv = Server(tmp_path)
    srv.start()
    try:
        yield srv
    finally:
        srv.close()


def outage_at(server, kill_step: int, restart_step: int | None, seen: list):
    """A `metrics_callback` that, after logging step `kill_step`, SIGKILLs the server, and after logging
    step `restart_step` (records still unsent, noted in `seen`) restarts it."""
    original = training.metrics_callback

    def make(outbox):
        class Outage(type(original(outbox))):
            def on_log(self, args, state, control, logs=None, **kwargs):
                super().on_log(args, state, control, logs=logs, **kwargs)
                if state.global_step == kill_step and server.proc is not None:
                    server.kill()
                elif state.global_step == restart_step and server.proc is None:
                    records, sent = durable.load(outbox.folder)
                    seen.append(len(records) - sent)
                    server.start()

        return Outage()

    return make


def sft_cfg(policy, out, steps=8):
    return configs.load(configs.SFTStageConfig, None, {
        "data": str(policy.train), "db_root": str(policy.db_root), "model": str(policy.tiny),
        "output_dir": str(out), "max_steps": steps, "per_device_train_batch_size": 4, "use_lora": True,
        "lora_r": 4, "lora_alpha": 8, "run_name": "outage"})


def only_run(client):
    (run,) = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])
    return run


def assert_complete_sft_run(client, run_id, steps):
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    for key in ("loss", "grad_norm", "learning_rate"):  # every step, none twice
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == list(range(1, steps + 1)), key
    assert run.data.metrics["steps"] == steps and run.data.tags["slmsql.policy_kind"] == "adapter"
    assert run.data.tags["mlflow.note.content"].startswith("SFT (LoRA adapter)")
    assert {"policy/adapter_model.safetensors", "policy/adapter_config.json", "policy/sft_summary.json"} <= \
        {f.path for f in client.list_artifacts(run_id, "policy")}


@pytest.mark.slow
def test_sft_keeps_training_through_a_server_restart(policy, server, tmp_path, monkeypatch):
    seen: list[int] = []
    out = tmp_path / "out"
    monkeypatch.setenv(durable.WAIT_ENV, str(watched.STALL_S))
    monkeypatch.setattr(training, "metrics_callback", outage_at(server, kill_step=2, restart_step=5, seen=seen))
    with tracking_store(server.uri):
        summary = sft.main(sft_cfg(policy, out))
    assert summary["steps"] == 8
    assert seen and seen[0] >= 3  # steps 3-5 (at least) waited on disk while the server was away
    assert (out / "adapter_model.safetensors").exists() and not durable.folder_for(out).exists()
    client = mlflow.MlflowClient(server.uri)
    assert_complete_sft_run(client, only_run(client).info.run_id, 8)


@pytest.mark.slow
def test_server_still_away_at_the_end_then_sync_sends_the_rest(policy, server, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv(durable.WAIT_ENV, "1")
    monkeypatch.setattr(training, "metrics_callback", outage_at(server, kill_step=2, restart_step=None, seen=[]))
    args = ["sft", "--data", str(policy.train), "--db-root", str(policy.db_root), "--model", str(policy.tiny),
            "--output-dir", str(out), "--max-steps", "6", "--per-device-train-batch-size", "4",
            "--use-lora", "true", "--lora-r", "4", "--lora-alpha", "8"]
    with tracking_store(server.uri):
        client = mlflow.MlflowClient(server.uri)
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2, result.output
        folder = durable.folder_for(out)
        assert f"kept in {folder}" in result.output
        assert f"slmsql sync-tracking {folder}" in result.output
        # the policy is finished and on disk: only the tracking is behind
        assert (out / "adapter_model.safetensors").exists() and not out.with_name("out.partial").exists()
        records, sent = durable.load(folder)
        assert records[-1]["kind"] == "end" and records[-1]["status"] == "FINISHED" and sent < len(records)

        server.start()
        run_id = only_run(client).info.run_id
        assert client.get_run(run_id).info.status == "RUNNING"
        [model] = client.search_logged_models([only_run(client).info.experiment_id])
        assert str(model.status) == "PENDING"  # the policy's LoggedModel: its end waits in the outbox too
        synced = CliRunner().invoke(cli, ["sync-tracking", str(folder)])
        assert synced.exit_code == 0, synced.output
    assert not folder.exists()
    assert_complete_sft_run(client, run_id, 6)
    assert str(client.get_logged_model(model.model_id).status) == "READY"


@pytest.mark.slow
def test_grpo_keeps_training_through_a_server_restart(policy, server, tmp_path, monkeypatch):
    """GRPO's per-step metrics and its completions tables (step 2's logged while the server was away)."""
    seen: list[int] = []
    data = write(tmp_path / "gold.jsonl", read(policy.train)[:8])
    cfg = configs.load(configs.GRPOStageConfig, None, {
        "data": str(data), "db_root": str(policy.db_root), "model": str(policy.model),
        "output_dir": str(tmp_path / "out"), "num_generations": 4, "per_device_train_batch_size": 8,
        "max_completion_length": 16, "max_steps": 4, "save_steps": 4, "completions_every": 2, "workers": 1,
        "timeout_s": 2.0, "lora_r": 4, "lora_alpha": 8})
    monkeypatch.setenv(durable.WAIT_ENV, str(watched.STALL_S))
    monkeypatch.setattr(training, "metrics_callback", outage_at(server, kill_step=1, restart_step=3, seen=seen))
    with tracking_store(server.uri):
        summary = grpo.main(cfg)
    assert summary["steps"] == 4 and seen and seen[0] >= 2
    client = mlflow.MlflowClient(server.uri)
    run = only_run(client)
    assert run.info.status == "FINISHED"
    for key in ("loss", "reward", "exec/correct"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [1, 2, 3, 4], key
    tables = sorted(f.path for f in client.list_artifacts(run.info.run_id, "completions"))
    assert tables == ["completions/step_00002.json", "completions/step_00004.json"]
    for t in tables:
        assert len(json.loads(Path(client.download_artifacts(run.info.run_id, t, str(tmp_path / "dl")))
                              .read_text())["data"]) == 8
    assert "training_curves.png" in {f.path for f in client.list_artifacts(run.info.run_id)}
    assert not durable.folder_for(cfg.output_dir).exists()
    [model] = client.search_logged_models([run.info.experiment_id])  # made while the server was up, finalized after
    assert str(model.status) == "READY" and model.source_run_id == run.info.run_id and model.name == "grpo"


@pytest.mark.slow
def test_a_record_the_server_refuses_is_set_aside_and_sync_tracking_shows_it(server, tmp_path):
    """On a real server: the stage's sender sets a refused record aside and sends the rest (the stage ends
    without an error); `slmsql sync-tracking` (a new process) does the same with an outbox left unsent, then
    shows what it set aside, with the server's reason, and shows it again once the outbox is gone."""
    import sys

    live, kept = tmp_path / "live.outbox", tmp_path / "kept.outbox"
    sync = [sys.executable, "-m", "slmsql.cli", "sync-tracking", str(kept)]
    with tracking_store(server.uri):  # the new process's MLFLOW_TRACKING_URI too
        with mlflow.start_run() as run, durable.Outbox(live, wait=watched.STALL_S) as box:
            box.start(run.info.run_id)
            for kind, payload in REFUSED:
                box.log_metrics(payload[0], step=payload[1]) if kind == "metrics" else box.set_tag(*payload)
            box.end_run("FINISHED")
        kept_run = left_unsent(kept, REFUSED)
        done = watched.run(sync)
        again = watched.run(sync)
    assert not live.exists() and "bad!key" in durable.refused(live)[0]
    assert done.returncode == 0, done.stderr
    assert f"sent 3 tracking record(s) to {server.uri}" in done.stdout and not kept.exists()
    assert f"1 record(s) the tracking server refused, set aside in {kept}.refused.jsonl" in done.stdout
    assert f"run {kept_run}: record 1 (tag): " in done.stdout and "bad!key" in done.stdout
    assert again.returncode == 0 and "tracking record(s) to" not in again.stdout and "bad!key" in again.stdout
    client = mlflow.MlflowClient(server.uri)
    for run_id in (run.info.run_id, kept_run):
        assert client.get_run(run_id).info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2]


def wait_for(condition, what: str):
    """Poll `condition` until it holds; past SLMSQL_TEST_STALL_S (a ceiling, not a verdict on speed), fail saying
    what never happened."""
    deadline = time.monotonic() + watched.STALL_S
    while not (got := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {watched.STALL_S:.0f} s for {what}; it never happened")
        time.sleep(0.05)
    return got


@pytest.mark.slow
def test_system_metrics_resume_after_an_outage(server, tmp_path, monkeypatch):
    """`system/*` goes through the outbox: samples taken while the server was away reach it once it is back,
    and sampling goes on to the run's end (MLflow's sampler quits at its first failed call). Each phase waits for
    what it needs (samples kept while away, samples sent after), not for a time."""
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")
    key = "system/cpu_utilization_percentage"
    client = mlflow.MlflowClient(server.uri)
    folder = tmp_path / "out.outbox"

    def samples():  # system samples in the outbox: (records, how many of all records were sent)
        records, sent = durable.load(folder)
        return [r for r in records if r["kind"] == "metrics" and key in r["metrics"]], sent

    with tracking_store(server.uri), durable.Outbox(folder, wait=watched.STALL_S) as box, \
            tracking.stage_run("sft", configs.load(configs.SFTStageConfig, None, {}), system_metrics=True,
                               outbox=box) as run:
        wait_for(lambda: client.get_metric_history(run.info.run_id, key), "a first sample to reach the server")
        server.kill()
        before = len(samples()[0])
        wait_for(lambda: len(samples()[0]) >= before + 3, "3 samples taken while the server is away")
        away = {r["n"] for r in samples()[0][before:]}
        server.start()
        wait_for(lambda: samples()[1] > max(away), "the samples taken while away to be sent")
        back = len(samples()[0])
        wait_for(lambda: len(client.get_metric_history(run.info.run_id, key)) >= back + 3,
                 "3 more samples sent after the server came back")
    points = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
    assert [m.step for m in points] == list(range(len(points)))  # none lost, none twice
    records = {r["n"]: r for r in samples()[0]} if folder.exists() else None
    assert records is None  # all sent: the outbox is gone
    assert len(points) >= back + 3 and len(away) >= 3


# ---- credentials turned away mid-run (an expired token): kept and retried, never set aside ---------------

def loss_at_step(n: int):
    """A proxy predicate: the request that logs step n's loss."""
    def sent(method, path, body):
        if not path.endswith("/runs/log-batch"):
            return False
        return any(m["key"] == "loss" and int(m.get("step", 0)) == n for m in json.loads(body or b"{}")["metrics"])
    return sent


@pytest.mark.slow
def test_credentials_turned_away_mid_run_pause_the_records_until_they_are_back(policy, server, tmp_path,
                                                                                 monkeypatch, caplog):
    """Behind a gateway that checks a bearer token, the token is revoked once step 2's loss is in (HTTP 401 on
    every later request), and taken back at step 5: the records in between wait in the outbox, none is set aside,
    and the run ends FINISHED with every step once, as after an outage."""
    from authproxy import AuthProxy

    seen = []
    out = tmp_path / "out"
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "token-1")
    monkeypatch.setenv(durable.WAIT_ENV, str(watched.STALL_S))
    original = training.metrics_callback
    with AuthProxy(server.uri, "token-1") as proxy:
        proxy.revoke_when(loss_at_step(2))

        def make(outbox):
            class Restore(type(original(outbox))):
                def on_log(self, args, state, control, logs=None, **kwargs):
                    super().on_log(args, state, control, logs=logs, **kwargs)
                    if state.global_step == 5:  # the revocation and a refusal have happened: records wait
                        wait_for(lambda: proxy.revoked.is_set() and proxy.refused, "a request refused 401")
                        records, sent = durable.load(outbox.folder)
                        seen.append(len(records) - sent)
                        proxy.restore()

            return Restore()

        monkeypatch.setattr(training, "metrics_callback", make)
        with tracking_store(proxy.url):
            summary = sft.main(sft_cfg(policy, out))
    assert summary["steps"] == 8 and seen and seen[0] >= 1
    assert "refused this process's credentials (HTTP 401" in caplog.text
    assert not durable.folder_for(out).exists() and not durable.refused_file(durable.folder_for(out)).exists()
    client = mlflow.MlflowClient(server.uri)
    run = only_run(client)
    assert_complete_sft_run(client, run.info.run_id, 8)
    [model] = client.search_logged_models([run.info.experiment_id])
    assert str(model.status) == "READY"


@pytest.mark.slow
def test_credentials_still_refused_at_the_end_fail_the_stage_and_sync_sends_once_fixed(policy, server, tmp_path):
    """`slmsql sft` (a new process) whose token is revoked after step 2 and never comes back: it trains to the
    end, keeps every later record and the files they name, exits non-zero saying how to resend; the run stays
    RUNNING and its LoggedModel PENDING. `slmsql sync-tracking` with the old token still fails and sets nothing
    aside; with the new token it sends everything and the run ends FINISHED."""
    import os
    import subprocess
    import sys

    from authproxy import AuthProxy

    out = tmp_path / "out"
    folder = durable.folder_for(out)
    args = ["sft", "--data", str(policy.train), "--db-root", str(policy.db_root), "--model", str(policy.tiny),
            "--output-dir", str(out), "--max-steps", "6", "--per-device-train-batch-size", "4",
            "--use-lora", "true", "--lora-r", "4", "--lora-alpha", "8"]
    with AuthProxy(server.uri, "token-1") as proxy:
        env = {**os.environ, "MLFLOW_TRACKING_URI": proxy.url, "MLFLOW_TRACKING_TOKEN": "token-1",
               durable.WAIT_ENV: "5"}
        cli_ = [sys.executable, "-m", "slmsql.cli"]
        proxy.revoke_when(loss_at_step(2))
        stage = watched.run(cli_ + args, env=env)
        assert stage.returncode == 2, stage.stderr[-3000:]
        assert "refused this process's credentials (HTTP 401" in stage.stderr
        assert f"send them with: slmsql sync-tracking {folder}" in stage.stderr
        assert "MLFLOW_TRACKING_TOKEN" in stage.stderr and "stays RUNNING" in stage.stderr
        assert (out / "adapter_model.safetensors").exists()  # the policy is done: only the tracking is behind
        records, sent = durable.load(folder)
        assert records[-1]["kind"] == "end" and sent < len(records)
        unsent = [r for r in records[sent:] if "file" in r]
        assert unsent and all((folder / r["file"]).exists() for r in unsent)  # no file of an unsent record deleted
        assert not durable.refused_file(folder).exists()  # credentials are no record's fault: nothing set aside
        client = mlflow.MlflowClient(server.uri)
        run = only_run(client)
        assert run.info.status == "RUNNING"
        [model] = client.search_logged_models([run.info.experiment_id])
        assert str(model.status) == "PENDING"

        stale = watched.run(cli_ + ["sync-tracking", str(folder)], env=env)
        assert stale.returncode == 2 and "credentials" in stale.stderr and "run this again" in stale.stderr
        assert folder.exists() and not durable.refused_file(folder).exists()
        fixed = watched.run(cli_ + ["sync-tracking", str(folder)], env={**env, "MLFLOW_TRACKING_TOKEN": "rotated"})
        assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert not folder.exists() and not durable.refused_file(folder).exists()
    assert_complete_sft_run(client, run.info.run_id, 6)
    assert str(client.get_logged_model(model.model_id).status) == "READY"
