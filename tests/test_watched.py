"""The tests' watchdog on progress (tests/watched.py): a child that goes silent is killed with everything it
started and fails the test saying it stalled; a child that keeps printing runs past the stall limit and hands
back its return code and output. Tiny limits here; the suite's are minutes (SLMSQL_TEST_STALL_S)."""

import os
import sys
import time

import psutil
import pytest
import watched

# prints, starts a grandchild in its process group that would outlive it, says who that is, then goes silent
SILENT_AFTER_HELLO = """
import subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("hello", g.pid, flush=True)
time.sleep(600)
"""

# prints every 50 ms for at least 5 s (100 sleeps), then ends with 3 after a word on stderr
CHATTY = """
import sys, time
for i in range(100):
    print("line", i)
    time.sleep(0.05)
print("bye", file=sys.stderr)
sys.exit(3)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # killed, waiting for init to reap it
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_a_silent_child_is_killed_with_its_process_group_as_stalled(tmp_path):
    with pytest.raises(watched.Stalled) as failed:
        watched.run([sys.executable, "-c", SILENT_AFTER_HELLO], stall_s=3, log=tmp_path / "log")
    message = str(failed.value)
    assert "stalled: no output for 3 s" in message and "timed out" not in message
    (line,) = [t for t in message.splitlines() if t.startswith("hello ")]  # the output's tail comes with it
    grandchild = int(line.split()[1])
    # SIGKILL was sent to the whole group before run() returned; its delivery to the sleeping grandchild is the
    # kernel's, so allow it a moment (a generous ceiling on an event, not a verdict on speed)
    deadline = time.monotonic() + watched.STALL_S
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild), "the stalled child's grandchild outlived it"
    assert (tmp_path / "log").read_text().startswith("hello ")


@pytest.mark.slow
def test_a_child_that_keeps_printing_runs_past_the_stall_limit_and_returns_its_output():
    done = watched.run([sys.executable, "-c", CHATTY], stall_s=3)  # it prints for 5 s and more
    assert done.returncode == 3
    assert done.stdout.splitlines() == [f"line {i}" for i in range(100)]  # unbuffered or not, all of it
    assert done.stderr == "bye\n"


@pytest.mark.slow
def test_the_ceiling_stops_a_child_that_prints_forever():
    forever = "import time\nwhile True:\n    print('tick', flush=True)\n    time.sleep(0.05)\n"
    with pytest.raises(watched.Stalled, match="ran past its ceiling of 2 s") as failed:
        watched.run([sys.executable, "-c", forever], stall_s=60, ceiling_s=2, text=False)
    assert "tick" in str(failed.value)


def test_the_child_gets_unbuffered_output_and_the_callers_environment(monkeypatch):
    monkeypatch.setenv("SLMSQL_WATCHDOG_PROBE", "yes")
    probe = ("import os; print(os.environ['PYTHONUNBUFFERED'], os.environ['SLMSQL_WATCHDOG_PROBE'], "
             "os.getpgid(0) == os.getpid())")
    assert watched.run([sys.executable, "-c", probe]).stdout.split() == ["1", "yes", "True"]
    only = watched.run([sys.executable, "-c", "import os; print(sorted(os.environ))"], env={"A": "b"},
                       cwd=os.sep).stdout
    assert "'A'" in only and "SLMSQL_WATCHDOG_PROBE" not in only
