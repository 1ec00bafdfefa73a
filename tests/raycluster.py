"""Test helper: a real Ray cluster, `ray start --head` on loopback as a process of its own (its own session), for the
tests that join one from another process (tests/test_ray.py, tests/test_study.py).

`ray_head(log, env)` starts it on a port its own processes listen on (tests/ports.py: started again on another port
if someone took the one handed out), yields (head process, port), and on leaving stops it: SIGTERM to each head
started (`ray start --block` stops its cluster on SIGTERM, draining first), then SIGKILL to whatever of its session
is left after a minute. Leaving normally, it fails if any process of a head's session is still there once
SIGKILLed (waited for up to SLMSQL_TEST_STALL_S, a ceiling): a test that used the cluster leaves none of it running.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import watched
from ports import session, start_serving


@contextlib.contextmanager
def ray_head(log: Path, env: dict | None = None) -> Iterator[tuple[subprocess.Popen, int]]:
    """The head's output is appended to `log`; `env`: its environment (None: this process's)."""
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    heads = []

    def start(port):
        heads.append(subprocess.Popen(
            [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--port", str(port),
             "--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--include-dashboard", "false",
             "--disable-usage-stats", "--temp-dir", temp],
            stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True, env=env))
        return heads[-1]

    def answers(port):
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True

    try:
        yield start_serving(start, answers, describe=log.read_text, members=session)
    finally:
        left = stop(heads)
        shutil.rmtree(temp, ignore_errors=True)
    assert not left, f"cluster processes left: {left}"


def stop(heads: list[subprocess.Popen]) -> list[int]:
    """Stop each head and its session; the pids of whatever is still running after that (none, normally)."""
    stragglers = []
    for head in heads:
        head.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=60)
        stragglers += session(head.pid)
    for p in stragglers:
        with contextlib.suppress(psutil.Error):
            p.kill()
    _, alive = psutil.wait_procs(stragglers, timeout=watched.STALL_S)  # gone, or named
    later = [p for head in heads for p in session(head.pid) if p not in stragglers]  # started while stopping
    return [h.pid for h in heads if h.poll() is None] + [p.pid for p in alive + later]
