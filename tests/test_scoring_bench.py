"""bench/scoring.py: its BIRD re-implementation behaves like BIRD's, its mixes have the promised shape, and the
three contenders agree on every score (so the bench compares speed, never different answers)."""

import importlib.util
import random
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_scoring", Path(__file__).parents[1] / "bench" / "scoring.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # (b) pickles its functions by module name
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def dbs(tmp_path_factory):
    root, rng = tmp_path_factory.mktemp("shops"), random.Random(1)
    paths = [str(root / f"shop{i}.sqlite") for i in range(2)]
    for p in paths:
        bench.build_db(p, rng)
    return paths


def test_func_timeout_abandons_the_call_and_stops_it_at_its_next_bytecode(monkeypatch):
    """Events, not wall-clock windows: the call blocks (in C, where the timeout exception cannot land) until the
    test lets it go, which is only after func_timeout has given up on it and asked for it to be stopped."""
    import ctypes

    finished, release = [], threading.Event()
    asked = threading.Event()  # func_timeout has set the exception that stops the call
    set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc

    def asking(*args):
        done = set_async_exc(*args)
        asked.set()
        return done

    monkeypatch.setattr(ctypes.pythonapi, "PyThreadState_SetAsyncExc", asking)

    def slow():
        release.wait()  # blocked in C: the timeout exception cannot land until it returns
        finished.append(True)

    watchdog = threading.Timer(120, release.set)  # were func_timeout to wait for the call, this would end it
    watchdog.start()
    before = set(threading.enumerate())
    try:
        with pytest.raises(bench.FunctionTimedOut):
            bench.func_timeout(0.02, slow)
        assert not release.is_set(), "func_timeout waited for the call instead of abandoning it"
        assert asked.wait(120), "func_timeout never asked the abandoned call to stop"
    finally:
        release.set()
        watchdog.cancel()
    for t in set(threading.enumerate()) - before - {watchdog}:
        t.join(120)
        assert not t.is_alive(), "the abandoned call was never stopped"
    assert not finished  # the exception landed once the call returned to bytecode: the rest never ran
    # a call that returns is waited for (thread.join(timeout)): a timeout no load reaches, as it returns at once
    assert bench.func_timeout(120.0, lambda x: x + 1, args=(1,)) == 2
    with pytest.raises(ZeroDivisionError):
        bench.func_timeout(120.0, lambda: 1 / 0)


def test_bird_execute_model_scores_set_equality_and_zero_on_error(dbs):
    db = dbs[0]
    gold = "SELECT name, city FROM customer WHERE id = 3"
    assert bench.bird_execute_model(f"{gold} UNION ALL {gold}", gold, db, 7, 1.0) == {"sql_idx": 7, "res": 1}
    assert bench.bird_execute_model("SELECT city, name FROM customer WHERE id = 3", gold, db, 0, 1.0)["res"] == 0
    assert bench.bird_execute_model("SELECT nope FROM customer", gold, db, 0, 1.0)["res"] == 0
    assert bench.bird_execute_model(gold, "SELECT nope FROM customer", db, 0, 1.0)["res"] == 0


def test_unique_mix_has_no_repeated_text(dbs):
    pairs = bench.unique_mix(dbs, 100, 0.02, random.Random(0))
    assert len(pairs) == 100 and len({p for _, p, _ in pairs}) == 100 and len({g for _, _, g in pairs}) == 100
    assert sum(p.startswith(bench.RUNAWAY) for _, p, _ in pairs) == 2


def test_grpo_mix_judges_each_gold_k_times_with_repeated_samples(dbs):
    pairs = bench.grpo_mix(dbs, questions=10, k=8, forms=2, share=0.025, rng=random.Random(0))
    assert len(pairs) == 80
    assert set(Counter(g for _, _, g in pairs).values()) == {8}
    assert all(len({db for db, _, g in pairs if g == gold}) == 1 for gold in {g for _, _, g in pairs})
    runaways = [p for _, p, _ in pairs if p.startswith(bench.RUNAWAY)]
    assert len(runaways) == 2 and len(set(runaways)) == 2  # each its own text: no de-duplication on them
    assert len({p for _, p, _ in pairs}) < 60  # a sampled policy repeats itself
    assert any(p != p.upper() and "select" in p for _, p, _ in pairs)  # the second surface form occurs


@pytest.mark.parametrize("mix", ["unique", "grpo"])
@pytest.mark.slow
def test_contenders_agree_and_stop_runaways(dbs, mix):
    rng = random.Random(2)
    if mix == "unique":
        pairs = bench.unique_mix(dbs, 40, 0.025, rng)
    else:
        pairs = bench.grpo_mix(dbs, questions=5, k=8, forms=2, share=0.025, rng=rng)
    # a runaway never finishes, so it times out at any deadline; the legitimate statements (joins over 20k-60k
    # rows, milliseconds each) must not, however loaded the machine: 1 s, not 0.3 s, which a loaded machine can
    # exceed on a join (each contender waits it out once per runaway: ~3 s per mix)
    fig = bench.run_mix(mix, pairs, timeout=1.0, workers=2)
    assert fig["runaways"] == 1 and fig["pool_statuses"]["timeout"] == 1
    assert fig["disagreements"] == {"a_b": 0, "a_c": 0}
    assert fig["ex"]["raw"] == fig["ex"]["bird"] == fig["ex"]["pool"] > 0
    assert fig["pool_statements"] == fig["distinct_golds"] + fig["distinct_preds"]
    if mix == "grpo":
        assert fig["pool_statements"] < 2 * fig["pairs"]
