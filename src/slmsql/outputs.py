"""Output folders that are either complete or absent.

A stage writes into `<out>.partial/` and renames it to `<out>` only when it succeeds, so a failed run
leaves no half-written output under the final name. Resumable stages (filter, grpo) keep `.partial/`
after a crash and pick up from it on the next run with the same output folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from .errors import SlmsqlError


def check_free(output_dir, overwrite: bool) -> Path:
    out = Path(output_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise SlmsqlError(f"output folder {out} exists and is not empty; pass --overwrite to replace it")
    return out


def partial_dir(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def promote(work: Path, out: Path) -> None:
    """Replace `out` by the finished `work` folder in one rename."""
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    os.replace(work, out)


@contextlib.contextmanager
def staged(output_dir, overwrite: bool = False, resumable: bool = False):
    out = check_free(output_dir, overwrite)
    work = partial_dir(out)
    if work.exists() and not resumable:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    try:
        yield work
    except BaseException:
        if not resumable:
            shutil.rmtree(work, ignore_errors=True)
        raise
    promote(work, out)
