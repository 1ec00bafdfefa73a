"""Training across processes for real: `sft` and `grpo` launched as two ranks on CPU (gloo, one thread each).

GRPO goes through `accelerate launch --config_file recipes/accelerate/ddp.yaml` (the README's multi-GPU
command, with `--num_processes 2 --mixed_precision no` for CPU), SFT through `torchrun`. Each launch must give
one MLflow run, FINISHED, with the world size and the launcher; each metric once per step; one output folder
(no `.partial`) with one adapter; no process left behind. Then each two-rank adapter (per-device batch B) is
compared with a one-process run on batch 2B (for GRPO on TRL's plain path, the ranks with the shared prefix on).
SFT has no sampling: the adapters must agree to float precision.
GRPO samples its completions, and TRL seeds every rank with seed + rank, so two ranks draw other
completions than one process does (measured: the updates differ by ~120% of their size, see README): the
GRPO launch samples through `rowseeded.py` (each row from its own prompt-and-index seed, whatever the
layout; the first two rows of each group pinned to a right and a no-SQL answer, so every group has a reward
difference and every step a gradient, on any machine), and the test checks that both layouts trained on the same prompts, completions and advantages at
every step and ended with the same adapter.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import pandas as pd
import psutil
import pytest
import torch
from click.testing import CliRunner
from policy import policy_fixture, read, tracking_store, write  # noqa: F401  (the fixture)
import ports
from safetensors.torch import load_file

import rowseeded
import scripted
import watched
from slmsql import cli, configs
from slmsql.runtime import distributed
from slmsql.sql.sandbox import SandboxPool
from slmsql.stages import grpo, sft

ROOT = Path(__file__).resolve().parents[1]
STEPS, G, B = 3, 4, 8  # optimizer steps; GRPO group size; GRPO per-device batch on each of the two ranks
LORA = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0}  # no dropout: its masks are drawn per rank
MARK = "SLMSQL_TEST_LAUNCH"  # set in every launched process (inherited by its children), to find leftovers


def grpo_options(policy, data, out, batch):
    return {"model": str(policy.model), "data": str(data), "db_root": str(policy.db_root), "output_dir": str(out),
            "max_steps": STEPS, "num_generations": G, "per_device_train_batch_size": batch,
            "max_completion_length": 40, "save_steps": 2, "experiment": "mp-grpo", **LORA}


def sft_options(policy, out, batch):
    return {"model": str(policy.tiny), "data": str(policy.train), "db_root": str(policy.db_root),
            "output_dir": str(out), "max_steps": STEPS, "per_device_train_batch_size": batch, "use_lora": True,
            "experiment": "mp-sft", **LORA}


def argv(options: dict) -> list[str]:
    return [a for k, v in options.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def leftovers(marker: str, grace_s: float = watched.STALL_S) -> list[str]:
    """Processes started by the launch still running after `grace_s` (exiting children get a moment: a ceiling
    on waiting for them to go, generous as a busy machine is slow to end them; nothing waits when none is left)."""
    deadline = time.monotonic() + grace_s
    while True:
        found = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if p.environ().get(MARK) == marker and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])[:200]}")
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def launch(cmd: list[str], cwd: Path, uri: str, **env) -> dict:
    """Run a launcher to completion in its own session (killed if it stalls); then kill what is left of that
    session, never more."""
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "MLFLOW_TRACKING_URI": uri, MARK: marker, **env}
    for k in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    done = watched.run(cmd, cwd=cwd, env=env, reap=False)  # what the launch left is looked for, then killed
    try:
        return {"rc": done.returncode, "log": done.stdout + done.stderr, "left": leftovers(marker)}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(done.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def launched(policy, tmp_path_factory):
    """The two launches, into one MLflow store."""
    root = tmp_path_factory.mktemp("ranks")
    uri = f"sqlite:///{root}/mlflow.db"
    data = write(root / "band.jsonl", [{**r, "pass_rate": 0.5, "k": 4, "n_correct": 2}
                                       for r in read(policy.train)[:16]])
    # accelerate's launcher takes a port number and binds it in its own process a moment later: launched again on
    # another port if someone took that one meanwhile (it fails at once, saying so). torchrun's --standalone lets
    # its store bind a port of its own choosing.
    for _ in range(4):
        grpo_run = launch(
            [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
             str(ROOT / "recipes/accelerate/ddp.yaml"), "--num_processes", "2", "--mixed_precision", "no",
             "--main_process_port", str(ports.handed_out()),
             str(ROOT / "tests/rowseeded.py"), "grpo", *argv(grpo_options(policy, data, root / "grpo", B))],
            root, uri, SLMSQL_TEST_GROUP=str(G), SLMSQL_TEST_PIN_DATA=str(data),
            SLMSQL_TEST_PIN_MODEL=str(policy.model))
        if grpo_run["rc"] == 0 or not ports.clashed(grpo_run["log"]):
            break
    sft_run = launch(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
         "-m", "slmsql.cli", "sft", *argv(sft_options(policy, root / "sft", B // 2))], root, uri)
    with tracking_store(uri):
        client = mlflow.MlflowClient()
        runs = {e.name: client.search_runs([e.experiment_id]) for e in client.search_experiments()}
    return {"root": root, "data": data, "uri": uri, "runs": runs, "grpo": grpo_run, "sft": sft_run}


def _one_run(launched, stage, experiment, launcher):
    result = launched[stage]
    assert result["rc"] == 0, result["log"][-6000:]
    assert result["left"] == [], f"processes left running after the launch: {result['left']}"
    # one run in all: none in another experiment (an MLflow call on rank 1 would start one in 'Default')
    assert sorted((name, len(runs)) for name, runs in launched["runs"].items() if runs) == \
        [("mp-grpo", 1), ("mp-sft", 1)]
    [run] = launched["runs"][experiment]
    assert run.info.status == "FINISHED"
    assert run.data.tags["slmsql.world_size"] == "2" and run.data.tags["slmsql.launcher"] == launcher
    assert run.data.tags["slmsql.stage"] == stage
    with tracking_store(launched["uri"]):
        client = mlflow.MlflowClient()
        for key in ("loss", "grad_norm", "learning_rate"):
            assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == list(range(1, STEPS + 1))
        artifacts = client.list_artifacts(run.info.run_id, "adapter" if stage == "grpo" else "policy")
        assert {Path(a.path).name for a in artifacts} >= {"adapter_model.safetensors", "adapter_config.json"}
    out = launched["root"] / stage
    assert out.is_dir() and not out.with_name(f"{stage}.partial").exists()
    assert [p.name for p in launched["root"].iterdir() if p.name.endswith(".partial")] == []
    return run, out


def lora_gap(a: dict, b: dict, part: str) -> float:
    """||a - b|| / ||b|| over one kind of LoRA matrix. lora_B starts at zero (PEFT's init), so there it is
    the gap between the two updates relative to the update itself."""
    keys = [k for k in b if part in k]
    assert keys and set(a) == set(b)
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in keys).sqrt() / sum((b[k] ** 2).sum() for k in keys).sqrt())


@contextlib.contextmanager
def one_thread():
    """This process on one thread, as each launched rank runs (OMP_NUM_THREADS=1 in `launch`): a thread count is
    a float path, and the one-process run must compute each row as the ranks do (rows are sampled alone,
    unpadded: tests/rowseeded.py, so batch shapes are not one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def assert_same_adapter(two_ranks: Path, one_rank: Path):
    a, b = load_file(two_ranks / "adapter_model.safetensors"), load_file(one_rank / "adapter_model.safetensors")
    assert lora_gap(a, b, "lora_B") < 1e-3  # measured ~1e-5 (GRPO), ~1e-6 (SFT); other completions: ~1
    assert max(float((a[k] - b[k]).abs().max()) for k in b) < 1e-4  # one optimizer step moves weights ~1e-3


# ---- GRPO: accelerate launch, two ranks -----------------------------------------------------------------

@pytest.mark.slow
def test_grpo_two_ranks_one_run_one_adapter(launched):
    run, out = _one_run(launched, "grpo", "mp-grpo", "accelerate")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter", "checkpoint-2", "checkpoint-3",
                                                     "completions", "summary.json"]
    # every rank saved its RNG state into the main process's checkpoint: the folder was shared, in time
    assert sorted(p.name for p in (out / "checkpoint-2").glob("rng_state*")) == ["rng_state_0.pth",
                                                                                 "rng_state_1.pth"]
    assert run.data.metrics["steps"] == STEPS


@pytest.mark.slow
def test_grpo_two_ranks_match_one_rank_with_twice_the_batch(launched, policy, tmp_path, monkeypatch):
    from transformers.generation.utils import GenerationMixin

    # as the launch samples: rows seeded by (prompt, index), the first two of each group pinned (a reward
    # difference in every group, so both layouts have a gradient to compare on any machine)
    scripted.install(monkeypatch, policy.model, scripted.right_and_no_sql_first(read(launched["data"])), G,
                     sample=rowseeded.row_seeded(GenerationMixin.generate, G))
    one = tmp_path / "grpo1"
    # the one process on TRL's plain path: the two ranks computed each prompt once (shared_prefix, the default)
    with one_thread():
        grpo.main(configs.load(configs.GRPOStageConfig, None,
                               {**grpo_options(policy, launched["data"], one, 2 * B), "workers": 1,
                                "shared_prefix": False}))
    [run] = launched["runs"]["mp-grpo"]
    assert run.data.tags["slmsql.shared_prefix"].startswith("on: ")
    two = launched["root"] / "grpo"
    for step in range(1, STEPS + 1):  # the same prompts, completions and group advantages at every step
        a, b = (pd.read_parquet(d / f"completions/completions_{step:05d}.parquet") for d in (two, one))
        cols = ["prompt", "completion", "execution", "advantage"]
        a, b = ([tuple(map(str, row)) for row in df[cols].itertuples(index=False)] for df in (a, b))
        assert len(a) == 2 * B and sorted(a) == sorted(b), f"step {step}"
    assert_same_adapter(two / "adapter", one / "adapter")


# ---- SFT: torchrun, two ranks ---------------------------------------------------------------------------

@pytest.mark.slow
def test_sft_two_ranks_one_run_one_adapter(launched):
    run, out = _one_run(launched, "sft", "mp-sft", "torchrun")
    assert (out / "adapter_model.safetensors").is_file() and not (out / "checkpoints").exists()
    assert run.data.tags["slmsql.policy_kind"] == "adapter"


@pytest.mark.slow
def test_sft_two_ranks_match_one_rank_with_twice_the_batch(launched, policy, tmp_path):
    one = tmp_path / "sft1"
    with one_thread():
        sft.main(configs.load(configs.SFTStageConfig, None, sft_options(policy, one, B)))
    assert_same_adapter(launched["root"] / "sft", one)


# ---- stages that run as one process; the rank helpers ------------------------------------------------------

PROTOCOL = """
import json, os, sys
from pathlib import Path
import torch.distributed as dist
from slmsql.runtime import distributed
from slmsql.errors import SlmsqlError
from slmsql.runtime.outputs import Staged

# the rendezvous: the test's own store, on a port it bound and holds (no port handed on for another to take)
store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False)
dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
rank, out, seen = dist.get_rank(), Path(sys.argv[1]), {}

def attempt(name, fn):
    try:
        seen[name] = ["ok", fn()]
    except SlmsqlError as e:
        seen[name] = ["error", str(e)]

attempt("same_config", lambda: distributed.check_same("config", {"lr": 1, "data": "a"}))
attempt("other_config", lambda: distributed.check_same("config", {"lr": 1, "data": "ab"[rank]}))
def staged():
    with Staged(out, identity={"k": 1}, resume=False) as st:
        st.bind("run-1")
        made = st.work.is_dir()
    return [made, st.run_id, out.is_dir(), sorted(p.name for p in out.parent.iterdir())]
attempt("staged", staged)
distributed.barrier()
if rank == 0:  # an unfinished run left behind
    (out.parent / "left.partial").mkdir()
distributed.barrier()
attempt("leftover", lambda: Staged(out.parent / "left", identity={"k": 1}, resume=False).__enter__() and None)
print(json.dumps(seen), flush=True)
dist.barrier()
dist.destroy_process_group()  # else gloo's threads may abort the interpreter at exit ("terminate called ...")
"""


@pytest.mark.slow
def test_ranks_share_one_folder_and_one_config(tmp_path):
    """Two real gloo ranks on the library alone (no model): the main process prepares and promotes the one
    output folder; its errors reach the other rank; a config that differs between ranks is refused on both."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # port 0: its own
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    with ThreadPoolExecutor(2) as ranks:  # both at once, each under the watchdog
        procs = list(ranks.map(lambda r: watched.run([sys.executable, "-c", PROTOCOL, str(tmp_path / "out")],
                                                     env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}), range(2)))
    assert [p.returncode for p in procs] == [0, 0], [p.stderr[-3000:] for p in procs]
    seen = [json.loads(p.stdout.strip().splitlines()[-1]) for p in procs]
    for rank, got in enumerate(seen):
        assert got["same_config"] == ["ok", None]
        assert got["other_config"][0] == "error" and "rank 1 resolved another config than rank 0 (fields " \
            "['data'])" in got["other_config"][1]
        assert got["staged"] == ["ok", [True, None, True, ["out"]]]  # one folder, promoted, nothing left
        assert got["leftover"][0] == "error" and got["leftover"][1].endswith(
            "left.partial holds an unfinished run: pass --resume to continue it, or --overwrite")
    assert seen[1]["leftover"][1].startswith("the main process failed: ")


def no_process_group(monkeypatch) -> None:
    """The state these tests are about, whatever ran before them in this pytest worker: no process group. vLLM's
    in-process engine leaves one of world size 1 (its model-parallel groups), and ranks then come from it."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)


@pytest.mark.parametrize("stage", ["filter", "evaluate"])
def test_one_process_stages_refuse_several_ranks(stage, tmp_path, monkeypatch):
    no_process_group(monkeypatch)
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(k, v)
    result = CliRunner().invoke(cli.main, [stage, "--data", str(tmp_path / "gold.jsonl"), "--db-root",
                                           str(tmp_path), "--output-dir", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert f"error: {stage} runs as one process, but torchrun started 2 (WORLD_SIZE=2)" in result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_ranks_from_the_launchers_environment(monkeypatch):
    no_process_group(monkeypatch)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "ACCELERATE_MIXED_PRECISION",
              "ACCELERATE_USE_DEEPSPEED", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert (distributed.rank(), distributed.world_size(), distributed.is_main(), distributed.launcher()) == \
        (0, 1, True, "none")
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert distributed.cpu_share() == 16 and SandboxPool().workers == 16
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # two machines of four processes
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert (distributed.rank(), distributed.world_size(), distributed.is_main(), distributed.launcher()) == \
        (3, 8, False, "torchrun")
    assert distributed.cpu_share() == 4 and SandboxPool().workers == 4 and SandboxPool(workers=7).workers == 7
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # accelerate launch goes through torchrun's code
    assert distributed.launcher() == "accelerate"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert distributed.launcher() == "accelerate+deepspeed"


def test_no_barrier_without_a_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    no_process_group(monkeypatch)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        distributed.barrier()


def test_a_killed_process_leaves_no_sandbox_workers(shop):
    """A rank killed outright (SIGKILL: the OOM killer, a launcher giving up on it) cannot close its sandbox
    pool; its workers must not outlive it (nor the forkserver they keep alive)."""
    marker = uuid.uuid4().hex
    code = ("import sys, time\nfrom slmsql.sql.sandbox import SandboxPool\npool = SandboxPool(workers=2)\n"
            "assert pool.run([(sys.argv[1], 'SELECT 1')])[0].status == 'ok'\nprint('ready', flush=True)\n"
            "time.sleep(600)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), MARK: marker}
    proc = subprocess.Popen([sys.executable, "-c", code, str(shop / "shop" / "shop.sqlite")], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        # the owner, its resource tracker and forkserver, at least one worker
        assert len([p for p in psutil.process_iter() if _marked(p, marker)]) >= 4
    finally:
        proc.kill()
        proc.wait()
    assert leftovers(marker) == []


def _marked(p, marker) -> bool:
    try:
        return p.environ().get(MARK) == marker
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
