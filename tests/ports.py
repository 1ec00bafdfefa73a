"""Loopback ports for the servers and launchers the tests start, safe beside other processes on the machine.

A port that the OS hands to bind(0), which the test then closes and passes on, is free for anyone until the
server binds it: another run's server, a launcher's store, an outgoing connection's local port. The server then
fails to start, or, worse, the test talks to someone else's server on that port. Instead:

- `refused_port()`: a port nothing listens on for as long as the test holds it (bound, never listening: a
  connection to it is refused, and no one else can bind it);
- `start_serving(start, up)`: a server started on a port just handed out, accepted only once the port's listener
  is the server's own process (or a child of it); on a clash, the server is stopped and started again on another
  port;
- `clashed(text)`: whether a launcher's output says its port was taken (then the launch is retried);
- `Front`: a port held for a whole test in front of a server that is killed and restarted (tests/test_outage.py):
  the address its clients know never changes hands, whatever port the server gets each time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator

import psutil
import watched

CLASH = ("address already in use", "eaddrinuse", "errno 98", "could not bind", "port is already in use",
         "already in use")


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port that refuses connections while the block runs: bound by this process, never listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def handed_out() -> int:
    """A port the OS would hand to bind(0) now: free at this moment only (callers check who listens on it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def session(sid: int) -> list[psutil.Process]:
    """Every process of session `sid` (a server started with start_new_session=True and all it started, however
    it daemonized them: Ray's head, for one)."""
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(p.pid) == sid:
                out.append(p)
    return out


def owns_port(pid: int, port: int, members: Callable[[int], list[psutil.Process]] = tree) -> bool:
    """Whether `port` listens in process `pid` or one of its children (or whatever `members(pid)` names)."""
    for p in members(pid):
        with contextlib.suppress(psutil.Error):
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
                    return True
    return False


def listener_elsewhere(pid: int, port: int, members: Callable[[int], list[psutil.Process]] = tree) -> bool:
    """Whether something that is not process `pid`'s tree answers on `port`."""
    with socket.socket() as s:
        s.settimeout(1)
        if s.connect_ex(("127.0.0.1", port)) != 0:
            return False
    return not owns_port(pid, port, members)


def clashed(text: str) -> bool:
    low = (text or "").lower()
    return any(c in low for c in CLASH)


def stop(proc) -> None:
    """SIGKILL a started server and everything it started (its workers)."""
    for p in reversed(tree(proc.pid)):
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=60)


class Clash(Exception):
    """The port handed out was taken by someone else before the server bound it."""


def start_serving(start: Callable[[int], object], up: Callable[[int], bool], timeout_s: float = watched.STALL_S,
                  attempts: int = 4, describe: Callable[[], str] = lambda: "",
                  members: Callable[[int], list[psutil.Process]] = tree) -> tuple[object, int]:
    """Start a server with `start(port)` (returns its Popen) on a port just handed out, and wait until `up(port)`
    and the port's listener is the server's own. On a clash (the server exits saying its address is in use, or
    someone else listens on the port) it is stopped and started again on another port, up to `attempts` times.
    Returns (process, port). `describe()` is added to a failure's message (the server's log); `members(pid)`:
    the server's processes, where they are not all its children (default: the process and its children).
    `timeout_s` is a ceiling for a server that neither comes up nor exits (SLMSQL_TEST_STALL_S: a busy machine
    is slow to start one, never a reason to fail)."""
    last = ""
    for _ in range(attempts):
        port = handed_out()
        proc = start(port)
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                last = describe()
                if clashed(last):
                    break  # again, on another port
                raise AssertionError(f"the server exited with code {proc.returncode}:\n{last[-3000:]}")
            if time.monotonic() > deadline:
                stop(proc)
                raise AssertionError(f"the server did not come up in {timeout_s:.0f} s:\n{describe()[-3000:]}")
            if owns_port(proc.pid, port, members):
                with contextlib.suppress(Exception):
                    if up(port):
                        return proc, port
            elif listener_elsewhere(proc.pid, port, members):
                stop(proc)  # someone else's server on the port: never talk to it
                last = f"port {port} taken by another process"
                break
            time.sleep(0.5)
    raise AssertionError(f"no free port after {attempts} attempts; last: {last[-3000:]}")


class Front:
    """A loopback port this test holds from start to end, piping each connection to the server's current port.
    While the server is down (`backend` None, or it refuses) a connection is reset at once, so a client sees the
    outage as it would at the server's own port; the server can restart on any port without the address its
    clients know ever being free for another process to take."""

    def __init__(self):
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.backend: int | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    @staticmethod
    def _reset(s: socket.socket):
        """Close with a reset (RST), waking a thread blocked reading it."""
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RD)
        with contextlib.suppress(OSError):
            s.close()

    def _serve(self, client: socket.socket):
        backend = self.backend
        try:
            if backend is None:
                raise OSError("down")
            upstream = socket.create_connection(("127.0.0.1", backend), timeout=10)
            upstream.settimeout(None)
        except OSError:
            self._reset(client)
            return
        with self._lock:
            self._open |= {client, upstream}
        done = threading.Semaphore(0)  # one release per direction finished
        threading.Thread(target=self._pipe, args=(upstream, client, done), daemon=True).start()
        self._pipe(client, upstream, done)
        done.acquire()
        done.acquire()
        for s in (client, upstream):
            with contextlib.suppress(OSError):
                s.close()
            with self._lock:
                self._open.discard(s)

    def _pipe(self, src: socket.socket, dst: socket.socket, done: threading.Semaphore):
        """One direction, as TCP would carry it: an end (FIN) passed on as an end, a reset as a reset (a killed
        server resets its clients' connections)."""
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
        except OSError:
            self._reset(src)
            self._reset(dst)
        done.release()

    def down(self):
        """The server is gone: a new connection is reset at once. (Open ones end as the killed server's did.)"""
        self.backend = None

    def close(self):
        self._closed = True
        self.down()
        with self._lock:
            cut, self._open = list(self._open), set()
        for s in cut:
            self._reset(s)
        with contextlib.suppress(OSError):
            self._sock.close()
