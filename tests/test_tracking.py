from pathlib import Path

import pytest
from click.testing import CliRunner
from ports import refused_port
import watched

from slmsql.cli import main

EXAMPLES = Path(__file__).parents[1] / "examples"


def test_unreachable_tracking_server_fails_fast_with_no_output(tmp_path, monkeypatch):
    with refused_port() as port:  # held by this test, never listening: nothing can answer on it
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
        out = tmp_path / "out"
        result = CliRunner().invoke(main, ["evaluate", "--data", str(EXAMPLES / "gold.jsonl"), "--db-root",
                                           str(EXAMPLES / "databases"), "--predictions",
                                           str(EXAMPLES / "predictions.jsonl"), "--output-dir", str(out)])
    assert result.exit_code == 2
    assert f"tracking server http://127.0.0.1:{port} is unreachable" in result.output
    assert not out.exists() and not out.with_name("out.partial").exists()


def test_example_predictions_score_with_every_status(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["evaluate", "--data", str(EXAMPLES / "gold.jsonl"), "--db-root",
                                       str(EXAMPLES / "databases"), "--predictions",
                                       str(EXAMPLES / "predictions.jsonl"), "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    import json

    rows = {r["id"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert rows["q1"]["correct"] and rows["q2"]["correct"]          # bare SQL and a ```sql block
    assert rows["q5"]["status"] == "error" and "categry" in rows["q5"]["error"]
    assert rows["q6"]["status"] == "no_sql"
    assert rows["q7"]["status"] == "rejected"                       # DROP TABLE never runs
    assert rows["q8"]["status"] in ("truncated", "timeout")          # unbounded recursive CTE
    assert rows["q10"]["status"] == "missing"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n"] == 10 and metrics["ex"] == sum(r["correct"] for r in rows.values()) / 10


def test_server_store_is_a_sqlite_file_or_a_uri_as_given(tmp_path, monkeypatch):
    from slmsql.tracking.runs import server_command

    monkeypatch.chdir(tmp_path)
    cmd = server_command("127.0.0.1", 5000, "store.db", Path("art"))
    assert cmd[cmd.index("--backend-store-uri") + 1] == f"sqlite:///{tmp_path.resolve()}/store.db"
    pg = "postgresql+psycopg2://u:p@127.0.0.1:5432/mlflow"
    cmd = server_command("127.0.0.1", 5000, pg, Path("art"))
    assert cmd[cmd.index("--backend-store-uri") + 1] == pg
    assert cmd[cmd.index("--artifacts-destination") + 1] == str(tmp_path.resolve() / "art")


def test_server_cli_passes_backend_store_uri(monkeypatch):
    import signal

    from slmsql.tracking import runs as tracking

    seen = {}

    class Exited:  # stands in for the server process: already finished, so the CLI returns at once
        def wait(self, timeout=None):
            return 0

    def fake_start(host, port, store, artifacts):
        seen["store"] = store
        return Exited(), f"http://{host}:{port}"

    monkeypatch.setattr(tracking, "start_server", fake_start)
    before = signal.getsignal(signal.SIGTERM)
    try:
        pg = "postgresql+psycopg2://u:p@127.0.0.1:5432/mlflow"
        assert CliRunner().invoke(main, ["server", "--backend-store-uri", pg]).exit_code == 0
        assert seen["store"] == pg
        assert CliRunner().invoke(main, ["server", "--store", "x.db"]).exit_code == 0
        assert seen["store"] == "x.db"
    finally:
        signal.signal(signal.SIGTERM, before)  # the CLI maps SIGTERM to Ctrl-C; not for pytest itself


def test_every_run_that_samples_system_metrics_has_them_however_short(tmp_path, monkeypatch):
    """A run's metric names do not depend on how long it ran: a stage run far shorter than the sampling interval
    (an hour here) still gets its `system/*`, taken and logged as it ends, straight to the run (filter) and
    through an outbox (sft, grpo)."""
    import mlflow

    from slmsql import configs
    from slmsql.tracking import runs as tracking
    from slmsql.tracking.durable import Outbox

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "3600")
    cfg = configs.load(configs.SFTStageConfig, None, {})
    with tracking.stage_run("filter", cfg, system_metrics=True) as direct:
        pass
    with Outbox(tmp_path / "out.outbox", wait=60) as box, \
            tracking.stage_run("sft", cfg, system_metrics=True, outbox=box) as boxed:
        pass
    client = mlflow.MlflowClient()
    for run in (direct, boxed):
        got = client.get_run(run.info.run_id)
        assert got.info.status == "FINISHED"
        assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(got.data.metrics)
        assert [m.step for m in client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")] == [0]


@pytest.mark.slow
def test_a_stage_run_leaves_no_experiment_id_for_the_processes_started_after_it(tmp_path):
    """mlflow.set_experiment exports MLFLOW_EXPERIMENT_ID, an id of this store: a process started afterwards
    against another store would look for that experiment there. A stage run in this process leaves the
    environment as it found it."""
    import os
    import sys

    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["evaluate", "--data", str(EXAMPLES / "gold.jsonl"), "--db-root",
                                       str(EXAMPLES / "databases"), "--predictions",
                                       str(EXAMPLES / "predictions.jsonl"), "--output-dir", str(out),
                                       "--experiment", "second"])  # id 1: the store's second experiment
    assert result.exit_code == 0, result.output
    assert "MLFLOW_EXPERIMENT_ID" not in os.environ
    other = f"sqlite:///{tmp_path}/other.db"  # a fresh store: only experiment 0
    proc = watched.run([sys.executable, "-c", "import mlflow; print(mlflow.start_run().info.experiment_id)"],
                       env={**os.environ, "MLFLOW_TRACKING_URI": other})
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "0", proc.stderr[-2000:]


FAKE_SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_server_on_a_port_someone_took_is_started_again_on_another(monkeypatch):
    """start_server(port=0): the port the OS handed out is taken before the server binds it, by a process that
    answers /health too. That process is never taken for the server: it starts again on another port, and the
    uri it returns is where its own process listens. (A stand-in server, not `mlflow server`: seconds, not tens.)"""
    import socket
    import sys
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from slmsql.tracking import runs as tracking

    class Impostor(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    impostor = ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    taken = impostor.server_address[1]
    handed = iter([taken])  # the first port handed out is the impostor's; then the OS's own choice
    real_socket = socket.socket

    class Handing(real_socket):
        def getsockname(self):
            name = super().getsockname()
            return (name[0], next(handed, name[1]))

    monkeypatch.setattr(socket, "socket", Handing)
    monkeypatch.setattr(tracking, "server_command", lambda host, port, store, artifacts:
                        [sys.executable, "-c", FAKE_SERVER, str(port)])
    try:
        proc, uri = tracking.start_server(port=0, timeout_s=watched.STALL_S)
    finally:
        monkeypatch.setattr(socket, "socket", real_socket)
        impostor.shutdown()
    try:
        assert uri != f"http://127.0.0.1:{taken}" and tracking._listens(proc.pid, int(uri.rsplit(":", 1)[1]))
    finally:
        proc.kill()
        proc.wait()
