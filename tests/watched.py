"""Test helper: run a long subprocess (training, a pipeline, a study, a bench, a server's client, vLLM, Ray) with a
watchdog on its progress instead of a wall-clock timeout. A slow or busy machine makes a child slow, not silent;
a hung one goes silent. So the child is killed, with its whole process group, only when it has written nothing
to stdout or stderr for `stall_s` (SLMSQL_TEST_STALL_S, default 15 min), or, as a last resort, when it runs past
`ceiling_s` (SLMSQL_TEST_CEILING_S, default 4 h: many times the slowest run seen, a pipeline's ~25 min on a busy
2-core machine). Either way the test fails saying which, with the tail of the output.

The stages print often: tqdm bars (SFT/GRPO steps, filter questions, generation prompts), the trainer's log
lines and the steps' own lines. The child runs with PYTHONUNBUFFERED=1 so its stdout reaches the watchdog as it
is written, not in 8 KiB blocks. Whatever the outcome (done, stalled, the test interrupted), nothing of the
child's process group is left running."""

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

STALL_S = float(os.environ.get("SLMSQL_TEST_STALL_S", 15 * 60))
CEILING_S = float(os.environ.get("SLMSQL_TEST_CEILING_S", 4 * 3600))
TAIL = 4000  # characters of output a failure shows


class Stalled(AssertionError):
    """The child wrote nothing for `stall_s` (or ran past its ceiling) and was killed with its process group."""


def run(argv, *, stall_s: float | None = None, ceiling_s: float | None = None, log: Path | None = None,
        env: dict | None = None, text: bool = True, check: bool = False, reap: bool = True,
        **popen) -> subprocess.CompletedProcess:
    """subprocess.run(argv, capture_output=True, ...) with the watchdog: returns a CompletedProcess (returncode,
    stdout, stderr: str when `text`, else bytes), or raises Stalled. `log` also gets all output as it comes.
    Other keyword arguments (cwd, ...) go to Popen; the child leads a new session (its own process group: the
    result's `pid`). `reap=False` leaves what is left of that group once the child has ended, for a test that
    asserts nothing is (it is still killed on a stall or an interruption)."""
    stall_s = STALL_S if stall_s is None else stall_s
    ceiling_s = CEILING_S if ceiling_s is None else ceiling_s
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True, **popen)
    out, err, last = bytearray(), bytearray(), [time.monotonic()]
    sink = open(log, "ab") if log else None
    lock = threading.Lock()

    def pump(stream, into):
        for chunk in iter(lambda: stream.read1(65536), b""):
            with lock:
                into += chunk
                last[0] = time.monotonic()
                if sink:
                    sink.write(chunk)
                    sink.flush()

    streams = ((proc.stdout, out), (proc.stderr, err))
    readers = [threading.Thread(target=pump, args=pair, daemon=True) for pair in streams]
    for r in readers:
        r.start()
    start, verdict, ended = time.monotonic(), None, False
    try:
        while not _exited(proc.pid):
            now = time.monotonic()
            if now - last[0] > stall_s:
                verdict = f"stalled: no output for {stall_s:.0f} s (SLMSQL_TEST_STALL_S)"
            elif now - start > ceiling_s:
                verdict = f"ran past its ceiling of {ceiling_s:.0f} s (SLMSQL_TEST_CEILING_S) while still printing"
            if verdict:
                break
            time.sleep(min(0.2, stall_s / 4))
        else:
            ended = True
    finally:  # done, stalled or interrupted: the child is not reaped yet, so its pid still names its group
        if reap or not ended:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for r in readers:  # the group is gone, so the pipes' write ends are closed and the readers finish (but for
            r.join(timeout=60)  # a process left running that holds them: not waited for forever)
        if sink:
            sink.close()
    decode = (lambda b: bytes(b).decode(errors="replace")) if text else bytes
    if verdict:
        raise Stalled(f"{' '.join(map(str, argv))[:300]}\n{verdict}; killed with its process group.\n"
                      f"--- stdout tail ---\n{decode(out)[-TAIL:]}\n--- stderr tail ---\n{decode(err)[-TAIL:]}")
    done = subprocess.CompletedProcess(argv, proc.returncode, decode(out), decode(err))
    done.pid = proc.pid  # its process group's id
    if check:
        done.check_returncode()
    return done


def _exited(pid: int) -> bool:
    """Whether the child has ended, without reaping it (WNOWAIT): until it is reaped its pid cannot be reused,
    so killing its process group afterwards cannot reach anyone else's."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped by someone else's os.wait(): ended
        return True
