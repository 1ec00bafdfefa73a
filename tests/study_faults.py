"""Test helper: `python tests/study_faults.py CELL <slmsql args>` runs the slmsql CLI in this process with the Ray
task of a study's cells replaced by one that, for CELL's first attempt only, waits until the real task has started
the cell's process group and then SIGKILLs its own Ray worker: a worker killed mid-cell at a point the test
chooses, with no race between the test and the run. The marker file `killed-once` in the cell's folder holds the
process group that attempt left behind. Defined in __main__, so Ray ships the wrapper to its workers by value.
It lives here, not in the library (as driver_faults.py does)."""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from slmsql.cli import main
from slmsql.studies import dispatch

KILL = sys.argv.pop(1)


def cell_then_die(cwd, folder, cell_id, policy, band, workdir, env, reuse=True):
    where = Path(cwd) / workdir / "cells" / cell_id
    marker = where / "killed-once"
    if cell_id == KILL and not marker.exists():
        threading.Thread(target=dispatch.cell_task, args=(cwd, folder, cell_id, policy, band, workdir, env, reuse),
                         daemon=True).start()
        pgid = where / "attempt.pgid"
        deadline = time.monotonic() + float(os.environ.get("SLMSQL_TEST_STALL_S", 900))  # the tests' ceiling
        while not pgid.is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        marker.write_text(str(json.loads(pgid.read_text())["pgid"]))
        os.kill(os.getpid(), signal.SIGKILL)
    return dispatch.cell_task(cwd, folder, cell_id, policy, band, workdir, env, reuse)


cell_then_die.__module__ = "__main__"
dispatch.cell_task = cell_then_die

if __name__ == "__main__":
    main()
