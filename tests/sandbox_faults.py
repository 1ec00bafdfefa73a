"""Test helper: a sandbox job runner that fails on purpose, for the pool's crash and hang handling.

Passed as `SandboxPool(runner=faulty_run)`; it lives here, not in the library, and is imported by the pool's
worker processes (forkserver workers see the test session's sys.path).
"""

import os
import time

from slmsql.sql import sandbox


def faulty_run(db_file, sql, limits, whole=None):
    if sql == "-- slmsql-test: crash":
        os._exit(70)
    if sql == "-- slmsql-test: hang":
        time.sleep(60)  # the parent kills it long before; bounded in case the parent dies first
    return sandbox._run(db_file, sql, limits, whole)
