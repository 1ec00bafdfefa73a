"""The processes of a multi-process launch (torchrun, `accelerate launch`, deepspeed): who is who, and the few
rules that make N processes behave as one stage run.

- Ranks come from torch.distributed once it is initialised, else from the launcher's environment (RANK,
  WORLD_SIZE, LOCAL_WORLD_SIZE): a stage needs them before the trainer exists. Building the TRL config
  (TrainingArguments) initialises the process group through accelerate, the same group the trainer then uses;
  the training stages build it before they open their output folder and MLflow run, so `barrier` and
  `from_main` below always have a group to use when the world has several processes.
- The main process (rank 0) owns everything shared: the MLflow run, the output folder, the resume state.
  `from_main` runs a step there and hands every process its result, or its error (so no process waits
  forever for a main process that failed).
Without a launcher all of this is a no-op: world size 1, rank 0, main.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

from slmsql.errors import SlmsqlError


def _group():
    """torch.distributed when a process group exists; never imports torch just to find out."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip().isdigit() else default


def rank() -> int:
    dist = _group()
    return dist.get_rank() if dist else _env_int("RANK", 0)


def world_size() -> int:
    dist = _group()
    return dist.get_world_size() if dist else _env_int("WORLD_SIZE", 1)


def local_world_size() -> int:
    """Processes on this machine (torchrun and accelerate set LOCAL_WORLD_SIZE; else all of them)."""
    return max(1, _env_int("LOCAL_WORLD_SIZE", world_size()))


def is_main() -> bool:
    return rank() == 0


def cpu_share() -> int:
    """This process's share of the machine's CPUs: N processes on a machine split its cores, so N sandbox
    pools together start one worker per core, not N per core."""
    return max(1, (os.cpu_count() or 1) // local_world_size())


def launcher() -> str:
    """What started this process, from the environment the launchers set (recorded on the run)."""
    env = os.environ
    if "ACCELERATE_MIXED_PRECISION" in env:  # set by every `accelerate launch`
        return "accelerate+deepspeed" if env.get("ACCELERATE_USE_DEEPSPEED") == "true" else "accelerate"
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        return "mpirun"
    return "env" if "RANK" in env else "none"


def refuse(stage: str) -> None:
    """Stop a stage that runs as one process when a launcher started several."""
    if world_size() > 1:
        raise SlmsqlError(f"{stage} runs as one process, but {launcher()} started {world_size()} "
                          f"(WORLD_SIZE={world_size()}); start it without torchrun / accelerate launch. "
                          "Only sft and grpo train across processes.")


def _needs_group():
    dist = _group()
    if dist is None and world_size() > 1:
        raise RuntimeError("WORLD_SIZE > 1 but torch.distributed is not initialised: build the TRL config "
                           "(it initialises the process group) before opening the output folder or the run")
    return dist


def barrier() -> None:
    """Wait until every process gets here (nothing to wait for in a one-process world)."""
    if (dist := _needs_group()) is not None:
        dist.barrier()


def _broadcast(payload):
    box = [payload]
    _needs_group().broadcast_object_list(box, src=0)
    return box[0]


def receive():
    """On a non-main process: what the main process sent with `sending`, or its error raised here."""
    status, value = _broadcast(None)
    if status == "error":
        raise SlmsqlError(f"the main process failed: {value}")
    return value


@contextlib.contextmanager
def sending():
    """On the main process: `with sending() as send: ... send(value)`. If the block fails before it sends,
    the error is sent instead, so the processes waiting in `receive` stop with it rather than hang."""
    sent = False

    def send(value):
        nonlocal sent
        if world_size() > 1:
            _broadcast(("ok", value))
        sent = True

    try:
        yield send
    except BaseException as e:
        if not sent and world_size() > 1:
            message = str(e) if isinstance(e, SlmsqlError) else f"{type(e).__name__}: {e}"
            with contextlib.suppress(Exception):  # the others may be gone already
                _broadcast(("error", message))
        raise


def from_main(fn):
    """fn() on the main process only; every process returns its result (picklable), or raises its error."""
    if world_size() == 1:
        return fn()
    if not is_main():
        return receive()
    with sending() as send:
        result = fn()
        send(result)
    return result


def check_same(what: str, value: dict) -> None:
    """Refuse to go on unless every process holds the same `value` (e.g. the resolved config): the main
    process logs its own, which must be everyone's."""
    if world_size() == 1:
        return
    dist = _needs_group()
    mine = json.loads(json.dumps(value, default=str, sort_keys=True))
    every = [None] * world_size()
    dist.all_gather_object(every, mine)
    for r, other in enumerate(every):
        if other != every[0]:
            keys = sorted(k for k in set(other) | set(every[0]) if other.get(k) != every[0].get(k))
            raise SlmsqlError(f"rank {r} resolved another {what} than rank 0 (fields {keys}): launch every "
                              "process with the same arguments, recipe and environment")


def terminate_as_exit() -> None:
    """Make SIGTERM unwind the stack like an error (`SystemExit`): when one rank fails, the launcher SIGTERMs
    the others, which then close their MLflow run as FAILED and clean up instead of dying mid-write."""
    import signal
    import threading

    if world_size() > 1 and threading.current_thread() is threading.main_thread():
        def _exit(signum, frame):
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, _exit)
