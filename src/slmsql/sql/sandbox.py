"""Sandboxed SQLite execution of untrusted, model-written SQL.

Layers: a read-only URI connection; a whitelist authorizer (SELECT,
READ, FUNCTION, RECURSIVE) that also stops ATTACH / VACUUM INTO, PRAGMA, temp tables and writes;
SQLITE_LIMIT_ATTACHED=0 as a second lock on ATTACH; LENGTH limits against giant blobs; temp_store=MEMORY
with a hard heap limit so big sorts fail with MemoryError instead of filling the disk; a progress-handler
deadline; at most `row_cap` rows and `heap_bytes` of text/blob per result held as values. A job may ask for
the `Whole` result instead: past `row_cap` rows it is read on as value digests (matching.Digests, 8 bytes a
value) up to `digest_bytes`, and a prediction stops as soon as it can no longer match its gold. `SandboxPool`
adds RLIMIT_AS per worker, crash isolation and a hard kill of any job that outlives its deadline inside one
opcode.

Note: `PRAGMA hard_heap_limit` is process-wide, so `execute()` in-process also caps every other SQLite
connection of the calling process; the pool keeps it inside its workers.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import re
import resource
import signal
import sqlite3
import threading
import time
import urllib.parse
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Iterable

from slmsql.sql.matching import DIGEST_SIZE, Digests, digest_row

STATUSES = ("ok", "error", "timeout", "truncated", "rejected")
KILL_GRACE_S = 0.5        # pool: a job still running at deadline + grace gets its worker SIGKILLed
MAX_CHUNK = 64            # jobs per task sent to a worker: amortises IPC, bounds imbalance
MAX_CONNECTIONS = 32      # per process; page caches count against the (global) heap limit
_PROGRESS_OPS = 1000      # VM ops between deadline checks: <1% overhead, ~50 us overshoot

_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
_DENIED_FUNCTIONS = {"load_extension"}
_ACTIONS = {getattr(sqlite3, f"SQLITE_{n}"): n for n in (  # authorizer codes overlap error codes: list them
    "CREATE_INDEX CREATE_TABLE CREATE_TEMP_INDEX CREATE_TEMP_TABLE CREATE_TEMP_TRIGGER CREATE_TEMP_VIEW "
    "CREATE_TRIGGER CREATE_VIEW DELETE DROP_INDEX DROP_TABLE DROP_TEMP_INDEX DROP_TEMP_TABLE "
    "DROP_TEMP_TRIGGER DROP_TEMP_VIEW DROP_TRIGGER DROP_VIEW INSERT PRAGMA READ SELECT TRANSACTION UPDATE "
    "ATTACH DETACH ALTER_TABLE REINDEX ANALYZE CREATE_VTABLE DROP_VTABLE FUNCTION SAVEPOINT RECURSIVE").split()}
# Leading/trailing whitespace, semicolons and comments: SQL made only of these is empty.
# Atomic groups and possessive quantifiers: no backtracking, so hostile input ('-' * 10**5) stays linear.
_NOTHING = re.compile(r"(?>\s+|;|--[^\n]*+|/\*(?>.*?\*/|.*+))*+", re.S)
_SIZED = {str, bytes}


@dataclass(frozen=True)
class ExecResult:
    status: str               # one of STATUSES
    rows: tuple | Digests | None  # row tuples (ok, truncated), Digests (ok past row_cap on a Whole read), else None
    error: str | None         # SQLite's message (error), reason (rejected/timeout), None when ok
    elapsed_ms: float

    @property
    def ran(self) -> bool:
        return self.status in ("ok", "truncated")


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0
    row_cap: int = 10_000            # rows held as values; a Whole read goes on past them as digests
    max_sql_chars: int = 100_000
    heap_bytes: int = 256 << 20
    max_length: int = 10_000_000
    worker_memory_bytes: int = 2 << 30
    digest_bytes: int = 32 << 20     # a Whole result's digests: 4,194,304 values (e.g. 1M rows of 4 columns)


@dataclass(frozen=True)
class Whole:
    """A job's optional third element: read the whole result, but a prediction no further than it can still
    match its gold: `rows` (spider: more rows than the gold's multiset) or `distinct` (bird: more distinct rows
    than the gold's set; then only distinct rows are kept). Neither: a gold, read to the digest budget."""
    rows: int | None = None
    distinct: int | None = None


class _Guard:
    """Per-connection authorizer and deadline; remembers the first denied action for the message."""

    def __init__(self):
        self.denied: str | None = None
        self.deadline = 0.0

    def authorize(self, action, arg1, arg2, _db, _source):
        if action in _ALLOWED and arg2 not in _DENIED_FUNCTIONS:
            return sqlite3.SQLITE_OK
        if self.denied is None:
            self.denied = arg2 if action == sqlite3.SQLITE_FUNCTION else _ACTIONS.get(action, str(action))
        return sqlite3.SQLITE_DENY

    def expired(self) -> bool:
        return time.monotonic() > self.deadline


_local = threading.local()  # sqlite3 connections are per thread


def _connect(path: str, limits: Limits):
    cache = _local.__dict__.setdefault("conns", {})
    key = (path, limits.heap_bytes, limits.max_length, limits.max_sql_chars)
    hit = cache.pop(key, None)
    if hit is None:
        conn = sqlite3.connect(f"file:{urllib.parse.quote(path)}?mode=ro", uri=True, isolation_level=None)
        # Pragmas first: the authorizer below denies every PRAGMA.
        conn.execute(f"PRAGMA hard_heap_limit={int(limits.heap_bytes)}")
        conn.execute("PRAGMA temp_store=MEMORY")
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, limits.max_length)
        conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, min(limits.max_length, 4 * limits.max_sql_chars))
        guard = _Guard()
        conn.set_authorizer(guard.authorize)
        conn.set_progress_handler(guard.expired, _PROGRESS_OPS)
        hit = (conn, guard)
        while len(cache) >= MAX_CONNECTIONS:
            cache.pop(next(iter(cache)))[0].close()
    cache[key] = hit  # re-insert: dict order is the LRU order
    return hit


def _drop(path: str):
    cache = _local.__dict__.get("conns", {})
    for key in [k for k in cache if k[0] == path]:
        cache.pop(key)[0].close()


def _fetch(cur, limits: Limits):
    """At most row_cap + 1 rows and heap_bytes of text/blob, so a hostile result cannot exhaust memory."""
    want, rows, budget, step = limits.row_cap + 1, [], limits.heap_bytes, 16
    while len(rows) < want:
        batch = cur.fetchmany(min(want - len(rows), step))
        step = min(2 * step, 4096)  # grow: huge rows trip the budget early, small ones batch well
        if not batch:
            break
        budget -= sum([len(v) for v in itertools.chain.from_iterable(batch) if v.__class__ in _SIZED])
        if budget < 0:
            raise MemoryError
        rows += batch
    return rows


def _read_on(cur, rows: list, limits: Limits, whole: Whole) -> tuple[str, Digests | None, str | None]:
    """The rest of a Whole result past row_cap, as digests -> (status, Digests or None, why it stopped)."""
    seen = set() if whole.distinct is not None else None  # bird: only distinct rows count, and are kept
    data, n = bytearray(), 0
    bound, what = (whole.distinct, "distinct rows") if seen is not None else (whole.rows, "rows")
    width = len(cur.description)
    budget = limits.digest_bytes // (DIGEST_SIZE * max(1, width))  # rows that fit the digest budget
    # Values are dropped once digested, so only a batch is held: small enough that max_length values fit heap_bytes.
    step = max(1, min(4096, limits.heap_bytes // (limits.max_length * max(1, width))))
    while rows:
        for row in rows:
            d = digest_row(row)
            if seen is not None:
                if d in seen:
                    continue
                seen.add(d)
            else:
                data += d
            n += 1
        if bound is not None and n > bound:  # memory stays within the gold's size, and a cross join ends here
            return "truncated", None, f"more {what} than the gold's {bound:,}: cannot match"
        if n > budget:
            return "truncated", None, (f"more than {budget:,} rows: over the digest budget "
                                       f"({limits.digest_bytes:,} bytes)")
        rows = cur.fetchmany(step)
    return "ok", Digests(n, width, b"".join(seen) if seen is not None else bytes(data)), None


def _run(db_file, sql, limits: Limits, whole: Whole | None = None) -> tuple:
    """One query -> (status, rows, error, elapsed_ms): plain tuples are cheap to send between processes."""
    t0 = time.perf_counter()

    def out(status, rows=None, error=None):
        return status, rows, error, (time.perf_counter() - t0) * 1e3

    if not isinstance(sql, str):
        return out("rejected", error="sql is not a string")
    if len(sql) > limits.max_sql_chars:
        return out("rejected", error="sql too long")
    if _NOTHING.fullmatch(sql):
        return out("rejected", error="empty sql")
    sql = sql.rstrip(" \t\r\n\f;")  # "q;;" is one statement to a reader; SQLite would see two
    path = os.path.abspath(os.fspath(db_file))
    guard = cur = None
    try:
        conn, guard = _connect(path, limits)
        guard.denied, guard.deadline = None, time.monotonic() + limits.timeout_s
        cur = conn.execute(sql)
        if cur.description is None:
            return out("rejected", error="not a query")
        rows = _fetch(cur, limits)
        if len(rows) <= limits.row_cap:
            return out("ok", tuple(rows))
        if whole is None:
            return out("truncated", tuple(rows[: limits.row_cap]))
        return out(*_read_on(cur, rows, limits, whole))
    except MemoryError:
        cur = None
        _drop(path)
        return out("error", error="out of memory")
    except sqlite3.Error as e:
        msg = str(e)
        if guard is not None and guard.denied is not None:
            return out("rejected", error=f"not authorized: {guard.denied}")
        if isinstance(e, sqlite3.ProgrammingError) and "one statement" in msg:
            return out("rejected", error="multiple statements")
        if msg == "interrupted" and guard is not None and time.monotonic() >= guard.deadline:
            return out("timeout", error=f"timeout after {limits.timeout_s:g} s")
        return out("error", error=msg)
    except Exception as e:  # never raise: every input gets a status
        return out("error", error=f"{type(e).__name__}: {e}")
    finally:
        if cur is not None:
            try:
                cur.close()  # resets the statement: a truncated read must not hold its read lock
            except Exception:
                pass


def execute(db_file, sql: str, limits: Limits = Limits(), whole: Whole | None = None) -> ExecResult:
    """Run one query in this process on a cached read-only connection. Never raises."""
    return ExecResult(*_run(db_file, sql, limits, whole))


# ----------------------------------------------------------------------------------------------- pool
# Each worker owns a slot [pid, job id, start] in shared memory, so the parent can see what is running:
# it kills a job that outlives its deadline (stuck inside a single SQLite opcode, where the progress
# handler is never called) and knows which jobs were in flight when a worker died.

_worker: dict = {}


def _proc_start(pid: int) -> bytes | None:
    """The process's start time (Linux /proc), None once it is gone or a zombie; elsewhere b"" while alive."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return None if fields[0] in (b"Z", b"X") else fields[19]
    except FileNotFoundError:
        return None
    except OSError:  # no /proc: only whether the pid exists
        try:
            os.kill(pid, 0)
            return b""
        except ProcessLookupError:
            return None


def _exit_with_owner(owner: int) -> None:
    """End this worker once the process that owns the pool is gone (or a zombie). A worker holds both ends of
    its task queue and (under forkserver) keeps the forkserver alive, so nothing else would ever stop it: a
    `kill -9`d stage or a Ray actor killed with its driver would leave its workers behind for good, holding
    databases open. A daemon thread checks once a second (the start time guards against a reused pid)."""
    born = _proc_start(owner)

    def watch():
        while _proc_start(owner) == born and born is not None:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="slmsql-owner-watch", daemon=True).start()


def _init_worker(limits: Limits, slots, counter, runner, owner: int | None = None):
    if owner is not None:
        _exit_with_owner(owner)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = limits.worker_memory_bytes if hard == resource.RLIM_INFINITY else min(hard, limits.worker_memory_bytes)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    with counter.get_lock():
        slot, counter.value = counter.value, counter.value + 1
    slots[3 * slot] = os.getpid()
    _worker.update(limits=limits, slots=slots, slot=3 * slot, runner=runner)


def _run_chunk(chunk: list) -> list:
    limits, slots, s, runner = (_worker[k] for k in ("limits", "slots", "slot", "runner"))
    out = []
    for job_id, db_file, sql, *whole in chunk:
        # Write order matters: the parent trusts `start` only when it reads the same job id around it.
        slots[s + 2] = time.monotonic()
        slots[s + 1] = job_id
        out.append(runner(db_file, sql, limits, *whole))
        slots[s + 1] = -1
    return out


def _default_start_method() -> str:
    # fork copies the parent; with torch loaded that means its thread pools and a huge address space
    # (RLIMIT_AS then fails at once). forkserver forks from a clean interpreter that preloads this module.
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


class SandboxPool:
    """Process pool for many queries: results in job order, statuses never exceptions."""

    def __init__(self, workers: int | None = None, limits: Limits = Limits(), *,
                 chunksize: int | None = None, start_method: str | None = None, runner=None):
        """`runner(db_file, sql, limits) -> tuple` executes one job in a worker (default: the sandbox's own);
        a module-level function, so it pickles. Tests pass one that crashes or hangs on purpose.
        `workers` by default: this process's share of the CPUs (all of them, unless a launcher started
        several processes on this machine, each with its own pool)."""
        from slmsql.runtime.distributed import cpu_share  # here: the module itself imports nothing of slmsql

        self.workers = max(1, workers or cpu_share())
        self.limits, self.chunksize = limits, chunksize
        self._ctx = mp.get_context(start_method or _default_start_method())
        if self._ctx.get_start_method() == "forkserver":
            self._ctx.set_forkserver_preload(["slmsql.sql.sandbox"])
        self._runner = runner or _run
        self._gold: dict = {}
        self._pool = None
        self.rebuilds = 0  # how often a dead worker forced a new pool (for logs and tests)

    # -- public
    def run(self, jobs: Iterable[tuple]) -> list[ExecResult]:
        """Execute (db_file, sql) or (db_file, sql, Whole) jobs; identical jobs in one call run once."""
        keys = [(os.fspath(db), *rest) for db, *rest in jobs]
        unique = list(dict.fromkeys(keys))
        done = dict(zip(unique, self._execute(unique)))
        return [done[k] for k in keys]

    def run_gold(self, jobs) -> list[ExecResult]:
        """(db_file, sql) jobs read Whole, cached for the life of the pool; a result held as digests is not
        cached (it re-runs in the next call that needs it), so the cache holds at most row_cap rows a gold."""
        keys = [(os.fspath(db), sql) for db, sql in jobs]
        missing = [k for k in dict.fromkeys(keys) if k not in self._gold]
        done = dict(zip(missing, self._execute([(*k, Whole()) for k in missing])))
        self._gold.update((k, r) for k, r in done.items() if not isinstance(r.rows, Digests))
        return [self._gold.get(k) or done[k] for k in keys]

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals
    def _start(self):
        if self._pool is None:
            self._slots = self._ctx.Array("d", [-1.0] * (3 * self.workers), lock=False)
            counter = self._ctx.Value("i", 0)
            self._pool = ProcessPoolExecutor(
                self.workers, mp_context=self._ctx, initializer=_init_worker,
                initargs=(self.limits, self._slots, counter, self._runner, os.getpid()))
        return self._pool

    def _restart(self):
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = None
        self.rebuilds += 1

    def _in_flight(self) -> dict[int, tuple[int, float]]:
        """job id -> (pid, start) for every job a worker has begun and not finished."""
        s, out = self._slots, {}
        for i in range(0, len(s), 3):
            job = s[i + 1]
            start = s[i + 2]
            if job >= 0 and s[i + 1] == job:
                out[int(job)] = (int(s[i]), start)
        return out

    def _execute(self, jobs: list[tuple[str, str]]) -> list[ExecResult]:
        results: list = [None] * len(jobs)
        strikes = [0] * len(jobs)
        queue, isolate, blind = list(range(len(jobs))), deque(), 0
        while queue or isolate:
            # After a crash, each job that was in flight runs alone, so a second crash names its culprit.
            batch = [isolate.popleft()] if isolate else queue
            if batch is queue:
                queue = []
            left, suspects, killed = self._dispatch(batch, jobs, results)
            if not left:
                continue
            self._restart()
            for j in suspects:
                strikes[j] += 1
            blind = 0 if suspects or killed else blind + 1
            for j in left:
                if strikes[j] >= 2 or blind >= 3:  # blind: workers die before any job starts
                    results[j] = ExecResult("error", None, "worker crashed", 0.0)
                elif j in suspects:
                    isolate.append(j)
                else:
                    queue.append(j)
        return results

    def _dispatch(self, batch: list[int], jobs, results):
        """Run `batch`; returns (unfinished job ids, suspects of a crash, jobs killed for time)."""
        pool = self._start()
        futures, broken, i = {}, False, 0
        while i < len(batch):
            # Guided chunks: big while much is left (little IPC), small at the end (workers finish together).
            size = self.chunksize or max(1, min(MAX_CHUNK, (len(batch) - i) // (4 * self.workers)))
            ids, i = batch[i:i + size], i + size
            try:
                futures[pool.submit(_run_chunk, [(j, *jobs[j]) for j in ids])] = ids
            except BrokenProcessPool:  # a worker already died: what was not submitted stays unfinished
                broken = True
                break
        limit = self.limits.timeout_s + KILL_GRACE_S
        killed, pending = {}, set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)
            for f in done:
                ids = futures[f]
                try:
                    for j, r in zip(ids, f.result()):
                        results[j] = ExecResult(*r)
                except BrokenProcessPool:
                    broken = True
                except Exception as e:  # e.g. a result that failed to pickle: the chunk fails alone
                    for j in ids:
                        results[j] = ExecResult("error", None, f"{type(e).__name__}: {e}", 0.0)
            if broken:
                continue
            now = time.monotonic()
            for j, (pid, start) in self._in_flight().items():
                if now - start > limit and j not in killed:
                    killed[j] = now - start
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        for j, secs in killed.items():
            results[j] = ExecResult("timeout", None, f"timeout after {self.limits.timeout_s:g} s "
                                    "(worker killed)", secs * 1e3)
        left = [j for j in batch if results[j] is None]
        suspects = set(self._in_flight()) - set(killed) if left else set()
        return left, suspects, killed
