"""Test helper: are we under CI? Tests that must fail there rather than skip (a missing Ray, PostgreSQL) ask this.

CI systems set `CI` in their own spelling: `true` (GitHub Actions, GitLab), `True` (Azure Pipelines), `1`;
any of these, in any case, counts. Unset, empty, `false`, `0` do not.
"""

import os

_ON = {"true", "1", "yes", "on"}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in _ON


def require(present: bool, what: str, how: str) -> None:
    """A test's prerequisite: where it is missing, skip the test, but under CI fail it, naming what is missing
    and how CI provides it: a test that skips there passes for the wrong reason."""
    import pytest

    if present:
        return
    if in_ci():
        pytest.fail(f"{what} is missing; under CI this test must run ({how})", pytrace=False)
    pytest.skip(f"{what} is missing ({how})")
