import gc
import os
import shutil
import sqlite3
import sys

import pytest

# Tests never reach the Hugging Face Hub: models come from the cache (`make smollm2`) or are built here, and the
# Hub is the loopback stand-in (hubstub.py turns this off for the test that uses it). Set before anything imports
# huggingface_hub, which reads it once: without it, each load by Hub id on a machine with no route out waits
# minutes on the client's retries (178 s against 14 s for one SmolLM2 load and 8 answers, measured here).
os.environ["HF_HUB_OFFLINE"] = "1"


# Each pytest run gets a temp folder of its own. pytest's default (`pytest-of-<user>/pytest-<n>` in the system's
# temp folder) is one numbered series for every run of the user: runs at the same time on one machine (sessions,
# CI jobs, a `make test` beside a `make test-fast`) share it, and one run's cleanup and numbering act on the
# others' folders. A folder from mkdtemp is this run's alone; it is removed when every test passed and kept,
# named in the summary, when one failed. A --basetemp given on the command line is kept as given.
BASETEMP_PREFIX = "slmsql-pytest-"
BASETEMP_KEEP_S = 3 * 24 * 3600  # a failed run's folder is removed by the first run 3 days later (pytest's lock age)


@pytest.hookimpl(tryfirst=True)  # before pytest's own tmpdir plugin reads the option
def pytest_configure(config):
    import tempfile
    import time
    from pathlib import Path

    if config.option.basetemp is not None:
        return
    root = Path(tempfile.gettempdir())
    for old in root.glob(BASETEMP_PREFIX + "*"):  # failed runs' folders, long after anyone could be using them
        try:
            if old.is_dir() and not old.is_symlink() and time.time() - old.stat().st_mtime > BASETEMP_KEEP_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
    config.option.basetemp = tempfile.mkdtemp(prefix=BASETEMP_PREFIX, dir=root)
    config.stash[OWN_BASETEMP] = Path(config.option.basetemp)


OWN_BASETEMP = pytest.StashKey[object]()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    own = session.config.stash.get(OWN_BASETEMP, None)
    if own is None:
        return
    if exitstatus == 0:
        shutil.rmtree(own, ignore_errors=True)
    else:
        os.utime(own)  # its age counts from this run's end
        session.config.stash[OWN_BASETEMP] = None
        session.config.stash[KEPT_BASETEMP] = own


KEPT_BASETEMP = pytest.StashKey[object]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    kept = config.stash.get(KEPT_BASETEMP, None)
    if kept is not None:
        terminalreporter.write_line(f"this run's temp folders are kept in {kept}")


@pytest.fixture
def shop(tmp_path):
    """A tiny database at <root>/shop/shop.sqlite; returns the db root."""
    root = tmp_path / "dbs"
    (root / "shop").mkdir(parents=True)
    con = sqlite3.connect(root / "shop" / "shop.sqlite")
    con.executescript("""
        CREATE TABLE item (id INTEGER PRIMARY KEY, name TEXT, price REAL, kind TEXT);
        INSERT INTO item VALUES (1, 'pen', 1.5, 'office'), (2, 'cup', 4.0, 'kitchen'),
                                (3, 'pad', 2.25, 'office'), (4, 'pot', 9.0, 'kitchen');
    """)
    con.commit()
    con.close()
    return root


@pytest.fixture(scope="session")
def _empty_store(tmp_path_factory):
    """An MLflow SQLite store with its schema made and nothing in it but the Default experiment, which each test
    gets a copy of: making the schema (MLflow's migrations) costs 1-2 s in-process and about 4 s in a new
    process, per store, and most tests that track start one (measured on 2 cores)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    root = tmp_path_factory.mktemp("empty-store")
    store = SqlAlchemyStore(f"sqlite:///{root}/mlflow.db", str(root / "mlruns"))
    store.engine.dispose()  # everything on disk before the file is copied
    assert not list(root.glob("mlflow.db-*")), "a journal beside the template: its copy would be incomplete"
    return root / "mlflow.db"


@pytest.fixture(autouse=True)
def _isolated_mlflow(tmp_path_factory, monkeypatch, _empty_store):
    """Each test tracks into its own SQLite store, never the developer's mlflow.db: a copy of the empty store, in a
    folder of its own beside the test's tmp_path (which holds only what the test writes)."""
    folder = tmp_path_factory.mktemp("mlflow")
    shutil.copy(_empty_store, folder / "mlflow.db")
    with sqlite3.connect(folder / "mlflow.db") as con:  # the Default experiment's artifacts: this test's folder too
        con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                    (str(folder / "mlruns" / "0"),))
    con.close()
    uri = f"sqlite:///{folder}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    import mlflow  # set_tracking_uri is process-wide: undo whatever an earlier test's stage set

    mlflow.set_tracking_uri(uri)
    # and forget an earlier test's active experiment: its id means nothing in this store
    monkeypatch.setattr(mlflow.tracking.fluent, "_active_experiment_id", None)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    yield
    os.environ.pop("MLFLOW_EXPERIMENT_ID", None)  # set_experiment exports it; delenv of an absent var restores nothing
    while mlflow.active_run():
        mlflow.end_run()


@pytest.fixture(autouse=True)
def _documented_metrics_only(monkeypatch):
    """Every metric any stage logs, in any test, must be in the documented vocabulary for that stage
    (`vocabulary.VOCABULARY`, docs/vocabulary.md): an undocumented name fails the test that logged it."""
    import mlflow

    from slmsql.tracking import vocabulary

    stages: dict[str, str] = {}

    def check(names):
        active = mlflow.active_run()
        if active is None:
            return
        run_id = active.info.run_id
        if run_id not in stages:
            stages[run_id] = mlflow.get_run(run_id).data.tags.get("slmsql.stage", "")
        stage = stages[run_id] or None
        bad = [n for n in names if not vocabulary.documented(n, stage)]
        assert not bad, f"{stage} logged metric(s) {bad} that are not in vocabulary.VOCABULARY (docs/vocabulary.md)"

    log_metric, log_metrics = mlflow.log_metric, mlflow.log_metrics

    def checked_metric(key, *args, **kwargs):
        check([key])
        return log_metric(key, *args, **kwargs)

    def checked_metrics(metrics, *args, **kwargs):
        check(list(metrics))
        return log_metrics(metrics, *args, **kwargs)

    from slmsql.tracking.durable import Outbox  # the training stages log through it (tracking/durable.py)

    outbox_metrics = Outbox.log_metrics

    def checked_outbox_metrics(self, metrics, *args, **kwargs):
        check(list(metrics))
        return outbox_metrics(self, metrics, *args, **kwargs)

    monkeypatch.setattr(mlflow, "log_metric", checked_metric)
    monkeypatch.setattr(mlflow, "log_metrics", checked_metrics)
    monkeypatch.setattr(Outbox, "log_metrics", checked_outbox_metrics)


# What `slow` means (pyproject.toml's marker): a test that trains a model, or starts a server or a launcher.
# Every test that asks for the trained tiny policy (tests/policy.py: an `slmsql sft` run, built once per session)
# trains one, so it is marked here, once, rather than by hand in each module; servers and launchers are marked
# where they are started. tests/test_project.py checks that every module keeps a test outside the slow tier.
TRAINS = {"policy"}
COLLECTED = pytest.StashKey[dict]()  # module file name -> has a test outside the slow tier


# The heaviest modules, heaviest first (seconds of tests on one worker, the whole suite on two: junit time on the
# Intel Xeon, 2026-12-06; the AMD EPYC's order was the same but for the first two): collected first, so that with `--dist loadfile --no-loadscope-reorder` (the Makefile's) each worker
# starts on one and the light modules fill in around them (longest first). By xdist's default order, by number of
# tests, the real-model module (5 tests, 980 s) started last: one worker ran 3070 s, the other 2389 s.
HEAVIEST_FIRST = ("test_pipeline", "test_real_model", "test_bench", "test_study", "test_ray", "test_vllm_grpo",
                  "test_outage", "test_shared_prefix", "test_sweep", "test_vllm", "test_shared_schema",
                  "test_qwen_coder", "test_publish", "test_text2sql", "test_multiprocess")


def _module_rank(item) -> int:
    module = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
    return HEAVIEST_FIRST.index(module) if module in HEAVIEST_FIRST else len(HEAVIEST_FIRST)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if TRAINS & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_module_rank)  # stable: each module's own order is kept
    # Over everything this session collected, before -m or -k deselect anything (this hook runs before pytest's
    # own): the `fast_modules` fixture, so that test_project need not collect the whole suite again (~15 s).
    fast = config.stash.setdefault(COLLECTED, {})
    for item in items:
        module = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
        fast[module] = fast.get(module, False) or item.get_closest_marker("slow") is None


def pytest_collection_finish(session):
    # What collection imported and built (torch, transformers, MLflow, the test modules) lives to the session's end:
    # frozen out of the collector's reach, each full collection walks only what the tests made since. Measured on
    # 2 cores: the fast tier's 61 full collections took 43 s of its 185 s, ~0.7 s each over ~1.9M objects.
    gc.freeze()
    _frozen_at[0] = len(sys.modules)


_frozen_at = [0]  # len(sys.modules) at the last freeze


def pytest_unconfigure(config):
    gc.unfreeze()  # the interpreter's shutdown frees them (else nanobind reports triton's objects as leaked)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    # The tests import more as they go (TRL, vLLM, Ray: only where needed). At a module's end, its fixtures torn
    # down, when much was imported since the last freeze: collect (so no garbage is frozen), then freeze the rest.
    module = item.nodeid.split("::")[0]
    if nextitem is not None and nextitem.nodeid.split("::")[0] != module and len(sys.modules) > _frozen_at[0] + 200:
        gc.collect()
        gc.freeze()
        _frozen_at[0] = len(sys.modules)


@pytest.fixture
def fast_modules(request) -> dict[str, bool]:
    """{test module file name: whether it has a test outside the slow tier}, for every module this session
    collected, with conftest's marks, before -m or -k deselected any."""
    return dict(request.config.stash.get(COLLECTED, {}))
