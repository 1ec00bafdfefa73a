"""Test helper: are we under CI? Tests that must fail there rather than skip (a missing Ray, PostgreSQL) ask this.

CI systems set `CI` in their own spelling: `true` (GitHub Actions, GitLab), `True` (Azure Pipelines), `1`;
any of these, in any case, counts. Unset, empty, `false`, `0` do not.
"""

import os

_ON = {"true", "1", "yes", "on"}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in _ON
