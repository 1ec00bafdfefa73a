"""The team set-up, for real: Debian's PostgreSQL as the backend store of a real `mlflow server` (started with
`slmsql server --backend-store-uri postgresql+psycopg2://...`, served artifacts), one stage tracked on it, read back.

Everything listens on 127.0.0.1 only. Not covered: an S3/MinIO artifact store, an auth proxy, several users.
Where PostgreSQL is not installed the test is skipped, except under CI (`CI` true, True or 1: ci_env.in_ci),
where it fails: `.ci/run` installs Debian's package, so a skip there would hide a broken set-up.
"""

import contextlib
import glob
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import psutil
import pytest
from ci_env import in_ci
import ports
import watched

EXAMPLES = Path(__file__).parents[1] / "examples"
USER, DB = "slmsql", "mlflow"


def test_the_team_store_uri_reaches_mlflow_server_as_given_with_its_driver_installed():
    """The fast part of this module (nothing started): the PostgreSQL URI the team set-up uses goes to
    `mlflow server` unchanged, and its driver (the test extra's psycopg2) is importable, so the server can start."""
    import sqlalchemy

    from slmsql.tracking.runs import server_command

    uri = f"postgresql+psycopg2://{USER}:secret@127.0.0.1:5432/{DB}"
    cmd = server_command("127.0.0.1", 5000, uri, Path("artifacts"))
    assert cmd[cmd.index("--backend-store-uri") + 1] == uri
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "--serve-artifacts" in cmd
    assert sqlalchemy.engine.make_url(uri).get_dialect().import_dbapi().__name__ == "psycopg2"


def unavailable(reason: str):
    if in_ci():
        pytest.fail(f"{reason}; under CI this test must run (.ci/run installs Debian's postgresql)")
    pytest.skip(reason)


def pg_bindir() -> Path:
    """The newest Debian PostgreSQL server binaries (/usr/lib/postgresql/<major>/bin)."""
    found = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/postgres")]
    if not found:
        unavailable("PostgreSQL server binaries not found under /usr/lib/postgresql/*/bin "
                    "(apt-get install postgresql)")
    return max(found, key=lambda b: int(b.parent.name) if b.parent.name.isdigit() else -1)


def process_tree(proc: subprocess.Popen) -> set[tuple[int, float]]:
    """(pid, start time) of a process and all its descendants: the start time tells a reused pid apart."""
    p = psutil.Process(proc.pid)
    return {(q.pid, q.create_time()) for q in [p, *p.children(recursive=True)]}


def survivors(procs: set[tuple[int, float]]) -> list[psutil.Process]:
    alive = []
    for pid, started in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            q = psutil.Process(pid)
            if q.create_time() == started and q.status() != psutil.STATUS_ZOMBIE:
                alive.append(q)
    return alive


def still_running(procs: set[tuple[int, float]]) -> list[str]:
    return [f"{q.pid} {' '.join(q.cmdline())[:120]}" for q in survivors(procs)]


@contextlib.contextmanager
def postgres(root: Path):
    """initdb into a fresh folder and run `postgres` on 127.0.0.1:<free port> (password auth over TCP);
    yields (psycopg2 connection arguments for the database DB, the process, `SELECT version()`).
    Stopped with `pg_ctl stop -m fast`."""
    try:
        import psycopg2  # also the driver `mlflow server` uses for the postgresql+psycopg2:// store
    except ImportError:
        unavailable("psycopg2 is not installed (pip install -e '.[test]')")
    bindir = pg_bindir()
    if os.geteuid() == 0:  # postgres refuses to run as root: run it as Debian's `postgres` system user,
        try:               # in a folder it owns (pytest's tmp_path sits under a 0700 root-only folder)
            owner = pwd.getpwnam("postgres")
        except KeyError:
            unavailable("running as root and there is no `postgres` user to run PostgreSQL as")
        if not shutil.which("runuser"):
            unavailable("running as root and `runuser` is missing")
        base = Path(tempfile.mkdtemp(prefix="slmsql-pg-"))
        os.chown(base, owner.pw_uid, owner.pw_gid)
        as_owner = ["runuser", "-u", "postgres", "--"]
    else:
        base = root / "pg"
        base.mkdir()
        owner, as_owner = None, []
    password = os.urandom(12).hex()
    pwfile = base / "pwfile"
    pwfile.write_text(password + "\n")
    pwfile.chmod(0o600)
    if owner:
        os.chown(pwfile, owner.pw_uid, owner.pw_gid)
    data, log = base / "data", root / "postgres.log"
    proc = None
    try:
        init = watched.run([*as_owner, bindir / "initdb", "-D", data, "-U", USER, "--pwfile", pwfile,
                            "-E", "UTF8", "--locale=C", "--auth-local=trust", "--auth-host=scram-sha-256",
                            "--no-sync"], check=False, cwd=base)
        assert init.returncode == 0, f"initdb failed:\n{init.stdout[-2000:]}{init.stderr[-2000:]}"
        def start(port):
            with open(log, "ab") as out:
                return subprocess.Popen([*as_owner, bindir / "postgres", "-D", data, "-k", base,
                                         "-h", "127.0.0.1", "-p", str(port)], cwd=base, stdout=out,
                                        stderr=subprocess.STDOUT)

        def conn_at(port):
            return {"host": "127.0.0.1", "port": port, "user": USER, "password": password, "connect_timeout": 5}

        # on a port of its own: started again on another if someone took the one handed out (ports.py)
        proc, port = ports.start_serving(start, lambda p: psycopg2.connect(dbname="postgres", **conn_at(p)).close()
                                         is None, describe=log.read_text)
        conn = conn_at(port)
        admin = psycopg2.connect(dbname="postgres", **conn)
        admin.autocommit = True  # CREATE DATABASE cannot run inside a transaction
        with admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE {DB}")
            cur.execute("SELECT version()")
            version = cur.fetchone()[0]
        admin.close()
        yield {**conn, "dbname": DB}, proc, version
    finally:
        if proc is not None and proc.poll() is None:
            watched.run([*as_owner, bindir / "pg_ctl", "stop", "-D", data, "-m", "fast", "-w", "-t", "60"],
                        check=False, cwd=base)
            proc.wait(timeout=watched.STALL_S)
        if owner:
            shutil.rmtree(base, ignore_errors=True)


class TeamServer:
    def __init__(self, root: Path):
        self.root, self.stack = root, contextlib.ExitStack()
        self.mlflow_proc = self.pg_proc = None
        self.seen: set[tuple[int, float]] = set()
        try:
            self._start(root)
        except BaseException:
            self.close()  # a half-started set-up (postgres up, mlflow not) must not outlive the test
            raise

    def _start(self, root: Path):
        self.pg, self.pg_proc, self.pg_version = self.stack.enter_context(postgres(root))
        pg = self.pg
        # the driver named explicitly: SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, not psycopg2
        self.store_uri = f"postgresql+psycopg2://{USER}:{pg['password']}@127.0.0.1:{pg['port']}/{DB}"
        self.artifacts, log = root / "artifacts", root / "mlflow-server.log"
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}

        def start(port):
            with open(log, "ab") as out:  # the documented command, so its option and its shutdown are tested too
                self.mlflow_proc = subprocess.Popen(
                    [sys.executable, "-m", "slmsql.cli", "server", "--port", str(port),
                     "--backend-store-uri", self.store_uri, "--artifacts", str(self.artifacts)],
                    cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
            return self.mlflow_proc

        self.stack.callback(self._stop_mlflow)
        # the first start creates MLflow's schema in PostgreSQL (alembic migrations): slow on a slow machine
        _, self.port = ports.start_serving(
            start, lambda p: urllib.request.urlopen(f"http://127.0.0.1:{p}/health", timeout=2).status == 200,
            describe=log.read_text)
        self.uri = f"http://127.0.0.1:{self.port}"
        self.processes()

    def _stop_mlflow(self):
        if self.mlflow_proc.poll() is None:
            self.mlflow_proc.send_signal(signal.SIGTERM)  # what a service manager sends
            self.mlflow_proc.wait(timeout=watched.STALL_S)

    def processes(self) -> set[tuple[int, float]]:
        """Every process of both servers seen so far (a snapshot of the running trees is added)."""
        for proc in (self.mlflow_proc, self.pg_proc):
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    self.seen |= process_tree(proc)
        return self.seen

    def stop(self):
        self.stack.close()

    def close(self):
        """Stop, then kill whatever survived: the test fails on survivors, but must not leave them behind."""
        self.processes()
        self.stop()
        for q in survivors(self.seen):
            q.kill()


@pytest.fixture
def team_server(tmp_path):
    server = TeamServer(tmp_path)
    try:
        yield server
    finally:
        server.close()  # idempotent: the test stops it itself to check that nothing is left running


@pytest.mark.slow
def test_stage_tracked_on_mlflow_server_with_postgresql_backend(team_server, tmp_path):
    import mlflow
    import psycopg2

    work, out = tmp_path / "work", tmp_path / "work" / "eval"
    work.mkdir()
    env = {**os.environ, "MLFLOW_TRACKING_URI": team_server.uri}
    stage = watched.run([sys.executable, "-m", "slmsql.cli", "evaluate", "--data", str(EXAMPLES / "gold.jsonl"),
                         "--db-root", str(EXAMPLES / "databases"), "--predictions",
                         str(EXAMPLES / "predictions.jsonl"), "--output-dir", str(out)],
                        check=False, cwd=work, env=env)
    assert stage.returncode == 0, stage.stderr[-4000:]
    assert not (work / "mlflow.db").exists() and not (work / "mlruns").exists(), "tracked locally, not on the server"
    metrics = json.loads((out / "metrics.json").read_text())

    # read back through the server, as a team member would
    client = mlflow.MlflowClient(tracking_uri=team_server.uri)
    exp = client.get_experiment_by_name("slmsql")
    [run] = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["slmsql.stage"] == "evaluate"
    assert run.data.metrics["ex"] == float(f"{metrics['ex']:.6g}")  # logged to 6 significant digits
    assert run.info.artifact_uri.startswith("mlflow-artifacts:"), "artifacts must go through the server"
    got = client.download_artifacts(run.info.run_id, "results.jsonl", str(tmp_path / "download"))
    assert Path(got).read_bytes() == (out / "results.jsonl").read_bytes()
    [stored] = team_server.artifacts.rglob("results.jsonl")  # landed in the server's artifact folder
    assert stored.read_bytes() == (out / "results.jsonl").read_bytes()

    # and it really is PostgreSQL that holds the run
    with contextlib.closing(psycopg2.connect(**team_server.pg)) as con, con.cursor() as cur:
        cur.execute("SELECT status, name FROM runs WHERE run_uuid = %s", (run.info.run_id,))
        assert cur.fetchall() == [("FINISHED", run.info.run_name)]
        cur.execute("SELECT value FROM latest_metrics WHERE run_uuid = %s AND key = 'ex'", (run.info.run_id,))
        assert cur.fetchall() == [(metrics["ex"],)]
    assert "PostgreSQL" in team_server.pg_version

    # a clean stop leaves nothing running: server, its uvicorn worker, the postmaster and its backends
    procs = team_server.processes()
    assert len(procs) >= 4, procs  # slmsql server + uvicorn, runuser/postgres + background workers
    team_server.stop()
    assert team_server.mlflow_proc.returncode is not None and team_server.pg_proc.returncode is not None
    assert still_running(procs) == []  # nor anything of theirs listening (the ports may be anyone's now)
