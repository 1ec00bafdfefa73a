"""Scoring throughput: (a) raw sqlite3, (b) BIRD's evaluator, (c) slmsql's SandboxPool, on two query mixes.

Builds its own databases (4 shops, ~2 MB each) and scores (pred, gold) pairs: lookups, scans, joins,
aggregates, top-n, with preds that are right, wrong or broken, plus a share of runaway preds that never
finish (infinite recursive CTEs). All three contenders get the same pairs and the same `--timeout`.

Mixes (both run by default; ratios are wall-clock time of a or b over time of c, same pairs):
  unique  every pair has its own gold and every SQL text is unique (a trailing comment): BIRD's dev-set
          evaluation shape, where no caching or de-duplication can help anyone.
  grpo    the shape slmsql actually runs: the pass-rate filter and the GRPO reward score K sampled
          completions per question, so each gold is judged K times, and a sampled model repeats itself.
          Each sample draws a semantic variant (right 5 : wrong value 2 : wrong column 2 : broken 1, as
          in `unique`) and a surface form (as written 3 : keywords lower-cased 1); the share of distinct
          pred texts this gives is measured and printed. Runaways replace the same share of samples as in
          `unique`, each with its own text, so de-duplication never helps (c) on them.

Contenders:
  (a) raw: one process, serial, one cached connection per database, pred then gold for every pair (a
      failed pred skips its gold), set(pred) == set(gold); no sandbox, no cache. Runaways are stopped by a
      progress-handler deadline per statement (without one, (a) would never finish).
  (b) BIRD's `evaluation.py` (DAMO-ConvAI bird/llm/src/evaluation.py; bird-bench/mini_dev's
      evaluation_ex.py is the same code) with func_timeout 4.3.5's mechanism, re-implemented here because
      neither is a dependency: `multiprocessing.Pool(processes=workers)` (fork, mp.Pool's default on Linux
      for Python <= 3.13), one `apply_async(execute_model, ...)` per pair with a callback that collects
      results, then sorted by index; `execute_model` wraps `execute_sql` in func_timeout(timeout) and scores
      0 on FunctionTimedOut or any exception; `execute_sql` opens a NEW connection per pair, runs the pred
      THEN the gold (gold re-executed for every pair, no cache; a failed pred skips its gold), fetchall,
      set(pred) == set(gold). func_timeout runs the call in a daemon thread, joins it for `timeout`, then
      starts a helper thread that raises FunctionTimedOut in it every 2 s, waits min(0.1, timeout / 50) s
      and gives up. The exception only lands when the thread runs Python bytecode, never inside
      sqlite3_step (which holds no GIL and calls no Python without a progress handler), so a runaway
      query runs on, abandoned, taking its share of the cores until the pool exits. Not reproduced: the
      unmerged `sort_tuple` per-row sort of DAMO-ConvAI PR #162 (one stored commit has it); the timeout is
      `--timeout` for the whole pair, where BIRD's default is 30 s.
  (c) slmsql: `slmsql.sql.scoring.judge(items, SandboxPool(workers, Limits(timeout_s)))`, the code path the
      filter, the reward and evaluate run: gold via run_gold (cached by (db, sql) for the pool's life),
      preds via run (identical jobs in one call run once), slmsql.sql.matching.results_match in BIRD mode.
      Pool start-up and shutdown are timed.

What bounds c/b on the `unique` mix: (b) runs the same statements on the same number of processes as (c),
and its per-pair overheads (a fresh connection and schema read, a thread, one IPC round trip) are small
next to the statements themselves, so without runaways c/b is about 1 or below (`--runaway-share 0`).
What (b) loses is to its abandoned queries: each one keeps a core busy from its timeout until the pool
exits, so with R runaways spread evenly over the run and W workers, the workers get W / (W + k) of the
CPU while k are running, which stretches (b) by about 1 + R / (2W): ~2.25 for the default R = 5, W = 2.
That depends on the number of runaways, not their share, so at a fixed share c/b grows with the run
size: c/b >= 3 on `unique` needs R >= ~8 on 2 workers (e.g. the earlier default, --pairs 2500). On the
`grpo` mix (c) also runs each gold once and each distinct pred once, where (a) and (b) run both per pair.

c/a is bounded by the free cores: the pool needs an idle core per worker to beat a serial loop. On a
shared Linux machine with autogroup scheduling (kernel.sched_autogroup_enabled=1), CPU is shared fairly
between sessions first, so while another session is busy this whole run gets about one core however many
processes it starts, and c/a on `unique` falls to ~1 (serial against serial). The load average is printed
with every mix, and so are CPU seconds per contender (this process, the children it waited for, the live
pool workers): steadier than wall time on a shared machine, and (b)'s include its abandoned queries.

    PYTHONPATH=src python bench/scoring.py [--mix both|unique|grpo] [--pairs 1500] [--questions 200] [--k 8]
        [--forms 2] [--runaway-share 0.0032] [--timeout 1.0] [--workers N] [--dbs 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import random
import re
import sqlite3
import tempfile
import threading
import time

import psutil

from slmsql.sql.sandbox import _PROGRESS_OPS, Limits, SandboxPool

CITIES = ["Oslo", "Lima", "Pune", "Kiev", "Lyon", "Graz", "Cork", "Bari", "Nice", "Turku"]
CATEGORIES = ["tools", "toys", "books", "food", "garden", "music", "sport", "office"]
STATUSES = ["new", "paid", "shipped", "returned"]
RUNAWAY = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"
VARIANT_WEIGHTS = [5, 2, 2, 1]  # right, wrong value, wrong column/shape, broken
_KEYWORDS = re.compile(r"\b(SELECT|FROM|WHERE|AND|JOIN|ON|GROUP BY|ORDER BY|LIMIT|AS|DESC|ASC|LIKE|COUNT)\b")
FORMS = [lambda s: s, lambda s: _KEYWORDS.sub(lambda m: m.group().lower(), s)]  # same query, other text
FORM_WEIGHTS = [3, 1]


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


def add_runaways(pairs: list, share: float, rng: random.Random) -> int:
    """Replace round(share * len) preds, at random places, by runaways with texts of their own."""
    n = round(share * len(pairs))
    for r, i in enumerate(rng.sample(range(len(pairs)), n)):
        pairs[i] = (pairs[i][0], f"{RUNAWAY} /* r{r} */", pairs[i][2])
    return n


def unique_mix(dbs: list[str], n: int, share: float, rng: random.Random) -> list[tuple[str, str, str]]:
    pairs = []
    for i in range(n):
        gold, preds = gold_and_variants(rng)
        pred = rng.choices(preds, weights=VARIANT_WEIGHTS)[0]
        pairs.append((rng.choice(dbs), f"{pred} /* p{i} */", f"{gold} /* g{i} */"))
    add_runaways(pairs, share, rng)
    return pairs


def grpo_mix(dbs: list[str], questions: int, k: int, forms: int, share: float,
             rng: random.Random) -> list[tuple[str, str, str]]:
    """K samples per question; texts repeat only within a question, as a sampled policy repeats itself."""
    pairs = []
    for q in range(questions):
        db, (gold, preds), tag = rng.choice(dbs), gold_and_variants(rng), f" /* q{q} */"
        for _ in range(k):
            pred = rng.choices(preds, weights=VARIANT_WEIGHTS)[0]
            form = rng.choices(FORMS[:forms], weights=FORM_WEIGHTS[:forms])[0]
            pairs.append((db, form(pred) + tag, gold + tag))
    add_runaways(pairs, share, rng)
    return pairs


# ------------------------------------------------------------------------------- (a) raw, serial

def bench_raw(pairs, timeout: float) -> list[int]:
    conns: dict = {}

    def run(db, sql):
        if db not in conns:
            conns[db] = sqlite3.connect(db)
        conn, deadline = conns[db], time.monotonic() + timeout
        # The sandbox's check interval, so the deadline costs (a) what it costs (c).
        conn.set_progress_handler(lambda: time.monotonic() > deadline, _PROGRESS_OPS)
        return conn.execute(sql).fetchall()

    scores = []
    for db, pred, gold in pairs:
        try:
            p = run(db, pred)
            scores.append(int(set(p) == set(run(db, gold))))
        except Exception:
            scores.append(0)
    return scores


# ------------------------------------------------------------------------------- (b) BIRD

class FunctionTimedOut(BaseException):  # a BaseException in func_timeout too
    pass


def func_timeout(timeout, func, args=()):
    """func_timeout 4.3.5 (dafunc.func_timeout + StoppableThread._stopThread), without its bookkeeping."""
    ret, exception, stopped = [], [], []

    def funcwrap():
        try:
            ret.append(func(*args))
        except FunctionTimedOut:
            pass
        except Exception as e:
            if not stopped:
                exception.append(e)

    thread = threading.Thread(target=funcwrap, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        stopped.append(True)

        def raise_every_2s():  # JoinThread: lands only when the thread next runs bytecode
            while thread.is_alive():
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                           ctypes.py_object(FunctionTimedOut))
                thread.join(2.0)

        threading.Thread(target=raise_every_2s, daemon=True).start()
        thread.join(min(0.1, timeout / 50.0))
        raise FunctionTimedOut
    thread.join(0.5)  # as func_timeout does; the thread has finished, so this returns at once
    if exception:
        raise exception[0]
    if ret:
        return ret[0]


def bird_execute_sql(predicted_sql, ground_truth, db_path):
    conn = sqlite3.connect(db_path)
    cursor = conn.cursor()
    cursor.execute(predicted_sql)
    predicted_res = cursor.fetchall()
    cursor.execute(ground_truth)
    ground_truth_res = cursor.fetchall()
    res = 0
    if set(predicted_res) == set(ground_truth_res):
        res = 1
    return res  # conn is closed when the last reference goes, as in BIRD (mini_dev closes it explicitly)


def bird_execute_model(predicted_sql, ground_truth, db_place, idx, meta_time_out):
    try:
        res = func_timeout(meta_time_out, bird_execute_sql, args=(predicted_sql, ground_truth, db_place))
    except FunctionTimedOut:
        res = 0
    except Exception:
        res = 0
    return {"sql_idx": idx, "res": res}


def bench_bird(pairs, timeout: float, workers: int) -> list[int]:
    exec_result = []
    pool = mp.get_context("fork").Pool(processes=workers)
    for i, (db, pred, gold) in enumerate(pairs):
        pool.apply_async(bird_execute_model, args=(pred, gold, db, i, timeout), callback=exec_result.append)
    pool.close()
    pool.join()  # workers exit with os._exit: their abandoned threads die with them
    if len(exec_result) != len(pairs):  # BIRD drops a task that fails to pickle without a word; we don't
        raise RuntimeError(f"(b) returned {len(exec_result)} results for {len(pairs)} pairs")
    return [r["res"] for r in sorted(exec_result, key=lambda r: r["sql_idx"])]


# ------------------------------------------------------------------------------- (c) slmsql

def bench_pool(pairs, timeout: float, workers: int):
    # Imported here, not at the top: every forkserver worker re-runs the parent's __main__ script, and
    # slmsql.sql.scoring pulls in scipy and statsmodels (~2 s per pool start on 2 busy cores). The `slmsql`
    # console script, whose imports are light (~0.13 s), is what real runs have as __main__.
    from slmsql.sql.scoring import judge

    with SandboxPool(workers, Limits(timeout_s=timeout)) as pool:
        outcomes = judge(pairs, pool)
        worker_cpu = _descendants_cpu()  # before close: the workers are the forkserver's, not ours to wait for
    statuses = [o.status for o in outcomes]
    return [int(o.correct) for o in outcomes], {s: statuses.count(s) for s in sorted(set(statuses))}, worker_cpu


def _descendants_cpu() -> float:
    total = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            total += sum(p.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


# ------------------------------------------------------------------------------- driver

def run_mix(name: str, pairs, timeout: float, workers: int) -> dict:
    distinct_preds = len({(db, pred) for db, pred, _ in pairs})
    distinct_golds = len({(db, gold) for db, _, gold in pairs})
    runaways = sum(pred.startswith(RUNAWAY) for _, pred, _ in pairs)
    load = [round(os.getloadavg()[0], 2)]
    print(f"[{name}] {len(pairs)} pairs, {distinct_golds} distinct golds, {distinct_preds} distinct preds, "
          f"{runaways} runaway; load average {load[0]}", flush=True)
    secs, cpu, scores = {}, {}, {}
    for label, key, fn in [("a", "raw", lambda: bench_raw(pairs, timeout)),
                           ("b", "bird", lambda: bench_bird(pairs, timeout, workers)),
                           ("c", "pool", lambda: bench_pool(pairs, timeout, workers))]:
        # CPU seconds of this process, of children it waited for (b's workers, abandoned threads included)
        # and, for (c), of the live pool workers: on a shared machine a steadier figure than wall time.
        before, spawned = os.times(), _descendants_cpu()
        t0 = time.perf_counter()
        out = fn()
        secs[key] = time.perf_counter() - t0
        after = os.times()
        cpu[key] = sum(after[:4]) - sum(before[:4]) + (out[2] - spawned if key == "pool" else 0.0)
        scores[key] = out[0] if key == "pool" else out
        print(f"[{name}] ({label}) {key:4s} {secs[key]:7.2f} s  {len(pairs) / secs[key]:7.1f} pairs/s  "
              f"cpu {cpu[key]:6.2f} s  EX {sum(scores[key]) / len(pairs):.4f}", flush=True)
    statuses = out[1]
    load.append(round(os.getloadavg()[0], 2))
    fig = {
        "pairs": len(pairs), "distinct_golds": distinct_golds, "distinct_preds": distinct_preds,
        "runaways": runaways, "seconds": {k: round(v, 3) for k, v in secs.items()},
        "cpu_seconds": {k: round(v, 2) for k, v in cpu.items()},
        "pairs_per_s": {k: round(len(pairs) / v, 1) for k, v in secs.items()},
        "c_over_a": round(secs["raw"] / secs["pool"], 3), "c_over_b": round(secs["bird"] / secs["pool"], 3),
        "ex": {k: round(sum(v) / len(pairs), 4) for k, v in scores.items()},
        "disagreements": {"a_b": sum(x != y for x, y in zip(scores["raw"], scores["bird"])),
                          "a_c": sum(x != y for x, y in zip(scores["raw"], scores["pool"]))},
        "pool_statements": distinct_golds + distinct_preds, "pool_statuses": statuses, "load_avg_1m": load,
    }
    print(f"[{name}] c/a = {fig['c_over_a']:.2f}   c/b = {fig['c_over_b']:.2f}", flush=True)
    return fig


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mix", choices=["both", "unique", "grpo"], default="both")
    ap.add_argument("--pairs", type=int, default=1500, help="unique mix: (pred, gold) pairs")
    ap.add_argument("--questions", type=int, default=200, help="grpo mix: gold questions")
    ap.add_argument("--k", type=int, default=8, help="grpo mix: samples per question")
    ap.add_argument("--forms", type=int, default=2, choices=[1, 2], help="grpo mix: surface forms per variant")
    ap.add_argument("--runaway-share", type=float, default=0.0032, help="share of preds that never finish")
    ap.add_argument("--timeout", type=float, default=1.0, help="seconds, same for all three")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="processes for (b) and (c)")
    ap.add_argument("--dbs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    mixes = {}
    with tempfile.TemporaryDirectory(prefix="slmsql-bench-") as root:
        dbs = [os.path.join(root, f"shop{i}.sqlite") for i in range(args.dbs)]
        for path in dbs:
            build_db(path, rng)
        print(f"timeout {args.timeout:g} s, {args.workers} workers, {os.cpu_count()} CPUs", flush=True)
        if args.mix in ("both", "unique"):
            mixes["unique"] = run_mix("unique", unique_mix(dbs, args.pairs, args.runaway_share, rng),
                                      args.timeout, args.workers)
        if args.mix in ("both", "grpo"):
            pairs = grpo_mix(dbs, args.questions, args.k, args.forms, args.runaway_share, rng)
            mixes["grpo"] = run_mix(f"grpo k={args.k}", pairs, args.timeout, args.workers)
    figures = {"timeout_s": args.timeout, "workers": args.workers, "cpus": os.cpu_count(), "k": args.k,
               "runaway_share": args.runaway_share, "mixes": mixes,
               "c_over_a": {m: f["c_over_a"] for m, f in mixes.items()},
               "c_over_b": {m: f["c_over_b"] for m, f in mixes.items()}}
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
