"""Sandbox: every hostile class is refused or stopped, the database never changes, the pool survives."""

import hashlib
import os
import sqlite3

import pytest
from sandbox_faults import faulty_run
import watched

from slmsql.sql.sandbox import STATUSES, ExecResult, Limits, SandboxPool, execute

FAST = Limits(timeout_s=0.5)
CTE_FOREVER = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"


def make_db(path, n=300):
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, score REAL, blob BLOB)")
    conn.execute("CREATE TABLE u(id INTEGER PRIMARY KEY, t_id INTEGER REFERENCES t(id))")
    conn.executemany("INSERT INTO t VALUES (?, ?, ?, ?)",
                     [(i, f"n{i}", i / 2, bytes([i % 256])) for i in range(n)])
    conn.executemany("INSERT INTO u VALUES (?, ?)", [(i, i % 7) for i in range(n)])
    conn.execute("CREATE VIEW v AS SELECT id FROM t WHERE id < 3")
    conn.commit()
    conn.close()
    return str(path)


def fingerprint(path):
    st = os.stat(path)
    return hashlib.sha256(open(path, "rb").read()).hexdigest(), st.st_mtime_ns, st.st_size


@pytest.fixture
def db(tmp_path):
    return make_db(tmp_path / "db.sqlite")


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(workers=2, limits=FAST, runner=faulty_run) as p:
        yield p


def test_ok_keeps_python_values(db):
    r = execute(db, "SELECT id, name, score, blob, NULL FROM t WHERE id IN (1, 2) ORDER BY id;")
    assert r.status == "ok" and r.ran and r.error is None
    assert r.rows == ((1, "n1", 0.5, b"\x01", None), (2, "n2", 1.0, b"\x02", None))
    assert isinstance(r.rows, tuple) and isinstance(r.rows[0], tuple)
    assert execute(db, "SELECT * FROM v").rows == ((0,), (1,), (2,))
    assert execute(db, "SELECT id FROM t WHERE id < 0").rows == ()
    r = execute(db, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c LIMIT 3) SELECT x FROM c")
    assert r.rows == ((1,), (2,), (3,))


def test_error_keeps_sqlite_message(db, tmp_path):
    r = execute(db, "SELECT nope FROM t")
    assert (r.status, r.rows, r.error) == ("error", None, "no such column: nope")
    assert not r.ran
    assert execute(db, "SELEC 1").error.startswith('near "SELEC"')
    missing = execute(tmp_path / "missing.sqlite", "SELECT 1")
    assert missing.status == "error" and not (tmp_path / "missing.sqlite").exists()


def test_odd_path_is_quoted_into_the_uri(tmp_path):
    odd = make_db(tmp_path / "my db ?mode=rw#%.sqlite", 5)
    assert execute(odd, "SELECT count(*) FROM t").rows == ((5,),)


def test_truncated_at_row_cap(db):
    r = execute(db, "SELECT id FROM t ORDER BY id", Limits(row_cap=10))
    assert r.status == "truncated" and r.ran and r.rows == tuple((i,) for i in range(10))
    assert execute(db, "SELECT id FROM t LIMIT 10", Limits(row_cap=10)).status == "ok"


HOSTILE = [
    ("INSERT INTO t(name) VALUES ('x')", "not authorized: INSERT"),
    ("UPDATE t SET name = 'x'", "not authorized: UPDATE"),
    ("DELETE FROM t", "not authorized: DELETE"),
    ("DROP TABLE t", "not authorized: DELETE"),
    ("CREATE TABLE z(a)", "not authorized: INSERT"),
    ("CREATE TEMP TABLE z(a)", "not authorized: INSERT"),
    ("CREATE TEMP VIEW z AS SELECT 1", "not authorized: INSERT"),
    ("PRAGMA user_version = 7", "not authorized: PRAGMA"),
    ("PRAGMA journal_mode", "not authorized: PRAGMA"),
    ("SELECT load_extension('/tmp/evil')", "not authorized: load_extension"),
    ("BEGIN", "not authorized: TRANSACTION"),
    ("SELECT 1; DELETE FROM t", "multiple statements"),
    ("SELECT 1;\nSELECT 2;", "multiple statements"),
    ("", "empty sql"),
    (" ; -- nothing here", "empty sql"),
    ("SELECT 1 " + "x" * 1_000_000, "sql too long"),
]


@pytest.mark.parametrize("sql,reason", HOSTILE, ids=[h[1] + ":" + h[0][:20] for h in HOSTILE])
def test_hostile_rejected(db, sql, reason):
    before = fingerprint(db)
    r = execute(db, sql)
    assert (r.status, r.rows, r.error) == ("rejected", None, reason)
    assert fingerprint(db) == before
    assert execute(db, "SELECT count(*) FROM t").rows == ((300,),)  # connection still usable


@pytest.mark.parametrize("sql", ["ATTACH DATABASE '{out}' AS x", "VACUUM INTO '{out}'"])
def test_no_file_is_written(db, tmp_path, sql):
    out = tmp_path / "written.sqlite"
    before = fingerprint(db)
    r = execute(db, sql.format(out=out))
    assert (r.status, r.error) == ("rejected", "not authorized: ATTACH")
    assert not out.exists() and fingerprint(db) == before


@pytest.mark.parametrize("sql", [CTE_FOREVER, "SELECT count(*) FROM t a, t b, t c, t d, t e"])
def test_runaway_times_out(db, sql):
    r = execute(db, sql, Limits(timeout_s=0.3))
    assert (r.status, r.rows, r.error) == ("timeout", None, "timeout after 0.3 s")
    assert r.elapsed_ms >= 0.3e3  # stopped at its deadline, not before (how soon after: the machine's business)
    assert execute(db, "SELECT 1").status == "ok"  # the next query gets a fresh deadline


def test_huge_blob_is_an_error(db):
    r = execute(db, "SELECT length(randomblob(2e9))")
    assert (r.status, r.error) == ("error", "string or blob too big")


def test_test_hooks_are_inert_without_env(db):
    assert execute(db, "-- slmsql-test: crash").error == "empty sql"


def test_comment_heavy_sql_is_parsed_in_linear_time(db):
    # A backtracking "is it only comments?" regex takes exponential time on this.
    assert execute(db, "-" * 50_000 + "\nSELECT 1").rows == ((1,),)
    assert execute(db, "/* unterminated " + "-" * 50_000).error == "empty sql"


def test_never_raises(db):
    assert execute(db, None).status == "rejected"
    assert execute(db, "SELECT 'a\x00b'").status in STATUSES


# --------------------------------------------------------------------------------------------- pool

def test_pool_order_statuses_and_duplicates(pool, tmp_path):
    a, b = make_db(tmp_path / "a.sqlite", 50), make_db(tmp_path / "b.sqlite", 80)
    jobs = [(a if i % 2 else b, f"SELECT id FROM t WHERE id = {i}") for i in range(100)]
    jobs += [(a, "SELECT nope"), (b, "DROP TABLE t"), (a, CTE_FOREVER), (b, "SELECT count(*) FROM t")] * 2
    results = pool.run(jobs)
    assert [r.rows for r in results[:100]] == [((i,),) if i < (50 if i % 2 else 80) else () for i in range(100)]
    assert [r.status for r in results[100:]] == ["error", "rejected", "timeout", "ok"] * 2
    assert results[103].rows == ((80,),) and all(isinstance(r, ExecResult) for r in results)
    assert pool.run([]) == []


def test_pool_memory_limits(tmp_path):
    db = make_db(tmp_path / "m.sqlite", 2000)
    limits = Limits(timeout_s=10, heap_bytes=16 << 20, row_cap=100_000)
    with SandboxPool(workers=1, limits=limits) as p:
        big_sort, big_rows, fine = p.run([
            (db, "SELECT a.name || b.name || randomblob(50) FROM t a, t b ORDER BY 1"),
            (db, "SELECT randomblob(1000000) FROM t"),
            (db, "SELECT count(*) FROM t a, t b")])
        assert (big_sort.status, big_sort.error) == ("error", "out of memory")
        assert (big_rows.status, big_rows.error) == ("error", "out of memory")
        assert fine.rows == ((4_000_000,),)
        pid = int(p._slots[0])
        limit = next(line for line in open(f"/proc/{pid}/limits") if line.startswith("Max address space"))
        assert str(2 << 30) in limit


def test_pool_survives_worker_crash(pool, db):
    before = fingerprint(db)
    jobs = [(db, f"SELECT {i}") for i in range(40)]
    jobs[17] = (db, "-- slmsql-test: crash")
    rebuilds = pool.rebuilds
    results = pool.run(jobs)
    assert (results[17].status, results[17].error) == ("error", "worker crashed")
    assert [r.rows for i, r in enumerate(results) if i != 17] == [((i,),) for i in range(40) if i != 17]
    assert pool.rebuilds > rebuilds
    assert pool.run([(db, "SELECT 42")])[0].rows == ((42,),)
    assert fingerprint(db) == before


def test_pool_kills_a_job_stuck_past_its_deadline(pool, db):
    results = pool.run([(db, "-- slmsql-test: hang"), (db, "SELECT 1"), (db, "SELECT 2")])
    assert results[0].status == "timeout" and "killed" in results[0].error
    assert results[0].elapsed_ms >= FAST.timeout_s * 1e3  # killed past its deadline, not before
    assert [r.rows for r in results[1:]] == [((1,),), ((2,),)]


def test_pool_hostile_leaves_db_and_disk_untouched(pool, db, tmp_path):
    before = fingerprint(db)
    out = tmp_path / "x.sqlite"
    hostile = [sql for sql, _ in HOSTILE] + [f"ATTACH '{out}' AS x", f"VACUUM INTO '{out}'"]
    results = pool.run([(db, sql) for sql in hostile])
    assert {r.status for r in results} == {"rejected"}
    assert fingerprint(db) == before and not out.exists()


def test_gold_cache(pool, tmp_path):
    db = make_db(tmp_path / "g.sqlite", 10)
    first = pool.run_gold([(db, "SELECT count(*) FROM t"), (db, "SELECT max(id) FROM t")])
    conn = sqlite3.connect(db)  # change the data behind the cache's back
    conn.execute("DELETE FROM t")
    conn.commit()
    conn.close()
    again = pool.run_gold([(db, "SELECT max(id) FROM t"), (db, "SELECT count(*) FROM t")])
    assert [r.rows for r in first] == [((10,),), ((9,),)]
    assert again[0] is first[1] and again[1] is first[0]  # served from the cache, not re-run
    assert pool.run([(db, "SELECT count(*) FROM t")])[0].rows == ((0,),)  # run() does not cache


def test_pool_workers_die_when_the_pools_owner_is_killed(db, tmp_path):
    """SIGKILL the process that owns a pool (a Ray actor killed with its driver, a `kill -9`d stage): its
    workers hold both ends of their task queue (and keep the forkserver alive), so they never see EOF; they
    must still end (each watches its owner; the wait for them is a ceiling, SLMSQL_TEST_STALL_S)."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    owner = subprocess.Popen([sys.executable, "-c", f"""
import os, sys, time
from slmsql.sql.sandbox import SandboxPool
pool = SandboxPool(2)
pool.run([({str(db)!r}, "SELECT 1")] * 8)
print(" ".join(str(p) for p in pool._pool._processes), flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    workers = [int(p) for p in owner.stdout.readline().split()]
    assert workers and all(psutil.pid_exists(p) for p in workers)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + watched.STALL_S
    alive = workers
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in workers if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    for p in alive:  # clean up before failing
        os.kill(p, signal.SIGKILL)
    assert not alive, f"sandbox workers {alive} outlived the pool's owner"
