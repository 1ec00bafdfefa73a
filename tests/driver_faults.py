"""Test helper: `python tests/driver_faults.py N <stage> <args>` runs the slmsql CLI in this process and SIGKILLs
it (no cleanup at all, as `kill -9` from outside) right after the stage has written its N-th row (`answers:N`:
its N-th answer, evaluate's resume file, which is written per generation batch): a driver killed mid-run at a
point the test chooses, however fast or slow the machine, with no race between the test and the run. It lives here, not in the library (as sandbox_faults.py's faulty runner does)."""

import os
import signal
import subprocess
import sys

import watched

from slmsql.generation import engines
from slmsql.cli import main


def die_after(n: int, what: str = "rows") -> None:
    run = engines.run

    def run_then_die(work, examples, on_rows, **kwargs):
        written = 0

        def then_die(write):
            def write_then_die(items):
                nonlocal written
                write(items)  # the stage writes (and fsyncs) them
                written += len(items)
                if written >= n:
                    os.kill(os.getpid(), signal.SIGKILL)
            return write_then_die

        if what == "answers":
            return run(work, examples, on_rows, **{**kwargs, "on_answers": then_die(kwargs["on_answers"])})
        return run(work, examples, then_die(on_rows), **kwargs)

    engines.run = run_then_die  # the stages call engines.run at run time


def killed_after(n: int, args: list[str], what: str = "rows") -> subprocess.CompletedProcess:
    """Run `slmsql ARGS` in a new process killed right after its N-th row (or answer), under the tests' watchdog
    (which also kills what the kill -9 left of its process group: its sandbox workers); returns the finished
    process (its output as bytes)."""
    return watched.run([sys.executable, __file__, f"{what}:{n}", *args], text=False)


if __name__ == "__main__":
    what, _, n = sys.argv[1].rpartition(":")
    die_after(int(n), what or "rows")
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    main()
