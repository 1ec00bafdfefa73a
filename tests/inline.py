"""Test helper: the SandboxPool interface run in this process (no worker processes), for small, fast tests.

Not for library use: `PRAGMA hard_heap_limit` is process-wide, so in-process execution caps every SQLite
connection of the test process too.
"""

from slmsql.sql.sandbox import Limits, Whole, execute


class InlineExecutor:
    """The SandboxPool interface, run in this process: for small jobs and tests."""

    def __init__(self, limits: Limits = Limits()):
        self.limits, self._gold = limits, {}

    def run(self, jobs):
        return [execute(db, sql, self.limits, *whole) for db, sql, *whole in jobs]

    def run_gold(self, jobs):
        out = []
        for job in jobs:
            if job not in self._gold:
                self._gold[job] = execute(*job, self.limits, Whole())
            out.append(self._gold[job])
        return out

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
