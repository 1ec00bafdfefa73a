"""Scoring throughput: (a) raw sqlite3, (b) a BIRD-style evaluator, (c) SandboxPool, in one run.

Builds its own databases and a mix of (pred, gold) pairs: lookups, scans, joins, aggregates, top-n, with
preds that are right, wrong or broken, plus `--runaways` preds that never finish (infinite recursive CTEs).
Every SQL text is unique (a trailing comment), so no caching or de-duplication helps any contender.
All three use the same `--timeout`:
  (a) one process, serial, one cached connection per database; runaway queries are stopped by a
      progress-handler deadline (without it, (a) would never finish); set(pred) == set(gold).
  (b) BIRD's evaluation.py, minimally re-implemented: multiprocessing.Pool(workers), apply_async per
      pair, a fresh connection per pair, pred then gold under one func_timeout-style deadline (a thread
      joined with a timeout; the abandoned thread keeps running its query, as BIRD's does, and burns a
      core until the pool exits); set(pred) == set(gold).
  (c) slmsql.sandbox.SandboxPool (run_gold + run), pool start-up included; matched with
      slmsql.matching.results_match (BIRD mode) when that module exists, else set equality.
Queries/s counts every executed SQL statement: 2 per pair.

    PYTHONPATH=src python bench/scoring.py [--pairs 2500] [--runaways 8] [--timeout 1.0] [--workers N]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import random
import sqlite3
import tempfile
import threading
import time

from slmsql.sandbox import Limits, SandboxPool

CITIES = ["Oslo", "Lima", "Pune", "Kiev", "Lyon", "Graz", "Cork", "Bari", "Nice", "Turku"]
CATEGORIES = ["tools", "toys", "books", "food", "garden", "music", "sport", "office"]
STATUSES = ["new", "paid", "shipped", "returned"]
RUNAWAY = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"


def build_db(path: str, rng: random.Random):
    conn = sqlite3.connect(path)
    conn.executescript("""
        CREATE TABLE customer(id INTEGER PRIMARY KEY, name TEXT, city TEXT, segment TEXT);
        CREATE TABLE product(id INTEGER PRIMARY KEY, name TEXT, category TEXT, price REAL);
        CREATE TABLE orders(id INTEGER PRIMARY KEY, customer_id INTEGER, order_date TEXT, status TEXT);
        CREATE TABLE item(order_id INTEGER, product_id INTEGER, qty INTEGER);
        CREATE INDEX item_order ON item(order_id);
    """)
    conn.executemany("INSERT INTO customer VALUES (?,?,?,?)", [
        (i, f"cust{i}", rng.choice(CITIES), rng.choice("ABC")) for i in range(2000)])
    conn.executemany("INSERT INTO product VALUES (?,?,?,?)", [
        (i, f"prod{i}", rng.choice(CATEGORIES), round(rng.uniform(1, 200), 2)) for i in range(300)])
    conn.executemany("INSERT INTO orders VALUES (?,?,?,?)", [
        (i, rng.randrange(2000), f"202{rng.randrange(5)}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}",
         rng.choice(STATUSES)) for i in range(20000)])
    conn.executemany("INSERT INTO item VALUES (?,?,?)", [
        (rng.randrange(20000), rng.randrange(300), rng.randrange(1, 6)) for _ in range(60000)])
    conn.commit()
    conn.close()


def gold_and_variants(rng: random.Random) -> tuple[str, list[str]]:
    """A gold query and preds a model might write: equivalent, wrong value, wrong column, broken."""
    kind = rng.randrange(5)
    if kind == 0:
        k = rng.randrange(2000)
        q = "SELECT name, city FROM customer WHERE id = {}"
        return q.format(k), [f"SELECT c.name, c.city FROM customer AS c WHERE c.id = {k}", q.format(k + 1),
                             f"SELECT city, name FROM customer WHERE id = {k}", q.format(k).replace("city", "town")]
    if kind == 1:
        s, y = rng.choice(STATUSES), 2020 + rng.randrange(5)
        q = "SELECT count(*) FROM orders WHERE status = '{}' AND order_date >= '{}'"
        return q.format(s, y), [f"SELECT COUNT(id) FROM orders WHERE order_date >= '{y}' AND status = '{s}'",
                                q.format(s, y + 1), q.format(s.upper(), y), q.format(s, y).replace("status", "state")]
    if kind == 2:
        m = f"202{rng.randrange(5)}-{rng.randrange(1, 13):02d}"
        q = ("SELECT c.city, count(*) FROM orders o JOIN customer c ON c.id = o.customer_id "
             "WHERE o.order_date LIKE '{}%' GROUP BY c.city")
        return q.format(m), [q.format(m) + " ORDER BY 2 DESC", q.replace("c.city", "c.segment").format(m),
                             q.format(m).replace("count(*)", "count(DISTINCT o.customer_id)"),
                             q.format(m).replace("JOIN customer", "JOIN customers")]
    if kind == 3:
        k = rng.randrange(2000)
        q = ("SELECT p.category, sum(i.qty * p.price) FROM item i JOIN product p ON p.id = i.product_id "
             "JOIN orders o ON o.id = i.order_id WHERE o.customer_id = {} GROUP BY p.category")
        return q.format(k), [q.format(k), q.format(k + 1), q.format(k).replace("i.qty * p.price", "i.qty"),
                             q.format(k).replace("p.category", "p.kind")]
    c, n = rng.choice(CATEGORIES), rng.randrange(1, 10)
    q = "SELECT name, price FROM product WHERE category = '{}' ORDER BY price DESC LIMIT {}"
    return q.format(c, n), [q.format(c, n), q.format(c, n + 1), q.format(c, n).replace("DESC", "ASC"),
                            q.format(c, n).replace("LIMIT", "LIMT")]


def make_pairs(dbs: list[str], n: int, runaways: int, rng: random.Random) -> list[tuple[str, str, str]]:
    pairs = []
    for i in range(n):
        gold, preds = gold_and_variants(rng)
        pred = rng.choices(preds, weights=[5, 2, 2, 1])[0]
        pairs.append((rng.choice(dbs), f"{pred} /* p{i} */", f"{gold} /* g{i} */"))
    for i in rng.sample(range(n), runaways):
        pairs[i] = (pairs[i][0], f"{RUNAWAY} /* p{i} */", pairs[i][2])
    return pairs


# ------------------------------------------------------------------------------- (a) raw, serial

def bench_raw(pairs, timeout: float) -> list[int]:
    conns: dict = {}

    def run(db, sql):
        if db not in conns:
            conns[db] = sqlite3.connect(db)
        conn, deadline = conns[db], time.monotonic() + timeout
        conn.set_progress_handler(lambda: time.monotonic() > deadline, 1000)
        return conn.execute(sql).fetchall()

    scores = []
    for db, pred, gold in pairs:
        try:
            p = run(db, pred)
            scores.append(int(set(p) == set(run(db, gold))))
        except Exception:
            scores.append(0)
    return scores


# ------------------------------------------------------------------------------- (b) BIRD-style

class FunctionTimedOut(Exception):
    pass


def func_timeout(timeout, func, args):
    """func_timeout's mechanism: run in a daemon thread, join with a timeout, then try to raise an
    exception inside it. That only lands when the thread next runs Python bytecode, never while it is
    inside sqlite3 (which released the GIL), so the query runs on, abandoned."""
    box = {}

    def target():
        try:
            box["value"] = func(*args)
        except BaseException as e:  # noqa: BLE001 - reported to the caller, as func_timeout does
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(FunctionTimedOut))
        raise FunctionTimedOut
    if "error" in box:
        raise box["error"]
    return box["value"]


def bird_execute_sql(predicted_sql, ground_truth, db_path):
    conn = sqlite3.connect(db_path)
    cursor = conn.cursor()
    cursor.execute(predicted_sql)
    predicted_res = cursor.fetchall()
    cursor.execute(ground_truth)
    ground_truth_res = cursor.fetchall()
    return 1 if set(predicted_res) == set(ground_truth_res) else 0


def bird_execute_model(predicted_sql, ground_truth, db_place, idx, meta_time_out):
    try:
        res = func_timeout(meta_time_out, bird_execute_sql, args=(predicted_sql, ground_truth, db_place))
    except FunctionTimedOut:
        res = 0
    except Exception:
        res = 0
    return {"sql_idx": idx, "res": res}


def bench_bird(pairs, timeout: float, workers: int) -> list[int]:
    results = []
    pool = mp.get_context("fork").Pool(processes=workers)
    for i, (db, pred, gold) in enumerate(pairs):
        pool.apply_async(bird_execute_model, args=(pred, gold, db, i, timeout), callback=results.append)
    pool.close()
    pool.join()  # workers exit with os._exit: their abandoned threads die with them
    return [r["res"] for r in sorted(results, key=lambda r: r["sql_idx"])]


# ------------------------------------------------------------------------------- (c) SandboxPool

def bench_pool(pairs, timeout: float, workers: int):
    try:
        from slmsql.matching import results_match
        match, matcher = (lambda p, g: results_match(p, g, "bird")), "slmsql.matching.results_match(bird)"
    except ImportError:
        match, matcher = (lambda p, g: set(p) == set(g)), "set equality"
    with SandboxPool(workers, Limits(timeout_s=timeout)) as pool:
        golds = pool.run_gold([(db, gold) for db, _, gold in pairs])
        preds = pool.run([(db, pred) for db, pred, _ in pairs])
        statuses = [r.status for r in preds]
    scores = [int(p.status == "ok" and g.status == "ok" and match(p.rows, g.rows)) for p, g in zip(preds, golds)]
    return scores, matcher, {s: statuses.count(s) for s in sorted(set(statuses))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=2500, help="(pred, gold) pairs; 2 queries each")
    ap.add_argument("--runaways", type=int, default=8, help="preds that never finish")
    ap.add_argument("--timeout", type=float, default=1.0, help="seconds, same for all three")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="processes for (b) and (c)")
    ap.add_argument("--dbs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="slmsql-bench-") as root:
        dbs = [os.path.join(root, f"shop{i}.sqlite") for i in range(args.dbs)]
        for path in dbs:
            build_db(path, rng)
        pairs = make_pairs(dbs, args.pairs, args.runaways, rng)
        queries = 2 * len(pairs)
        print(f"{len(pairs)} pairs ({queries} queries, {args.runaways} runaway), timeout {args.timeout:g} s, "
              f"{args.workers} workers, {os.cpu_count()} CPUs", flush=True)
        secs, ex, scores = {}, {}, {}
        for label, name, fn in [("a", "raw", lambda: bench_raw(pairs, args.timeout)),
                                ("b", "bird", lambda: bench_bird(pairs, args.timeout, args.workers)),
                                ("c", "pool", lambda: bench_pool(pairs, args.timeout, args.workers))]:
            t0 = time.perf_counter()
            out = fn()
            secs[name] = time.perf_counter() - t0
            scores[name] = out[0] if name == "pool" else out
            ex[name] = sum(scores[name]) / len(pairs)
            print(f"({label}) {name:5s} {secs[name]:7.2f} s  {queries / secs[name]:8.0f} queries/s  "
                  f"EX {ex[name]:.4f}", flush=True)
        _, matcher, statuses = out
    qps = {k: queries / v for k, v in secs.items()}
    figures = {
        "pairs": len(pairs), "queries": queries, "runaways": args.runaways, "timeout_s": args.timeout,
        "workers": args.workers, "cpus": os.cpu_count(), "seconds": {k: round(v, 3) for k, v in secs.items()},
        "queries_per_s": {k: round(v, 1) for k, v in qps.items()},
        "pool_vs_raw": round(qps["pool"] / qps["raw"], 3), "pool_vs_bird": round(qps["pool"] / qps["bird"], 3),
        "ex": {k: round(v, 4) for k, v in ex.items()}, "pool_matcher": matcher, "pool_pred_statuses": statuses,
        "pool_raw_disagreements": sum(a != c for a, c in zip(scores["raw"], scores["pool"])),
    }
    print(f"c/a = {figures['pool_vs_raw']:.2f}   c/b = {figures['pool_vs_bird']:.2f}")
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
