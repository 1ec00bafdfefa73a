"""Output folders that are either complete or absent: the one helper every stage that writes a folder uses.

A stage writes into `<out>.partial/` and renames it to `<out>` only when it succeeds, so a failed run leaves
no half-written output under the final name. A resumable stage (filter, grpo) passes an `identity` (the
parameters that determine its result): a crash then keeps `.partial/` with `resume_state.json` (identity and
MLflow run id), and the next run with the same output folder and identity picks up from it, in the same
MLflow run. `resume=None` resumes whenever it can (filter); `resume=False` refuses a leftover `.partial/`
unless `overwrite` (grpo without --resume: an unfinished run is never silently thrown away).

Several processes (torchrun, `accelerate launch`): every one of them opens the same `Staged`, and the main
process alone prepares `.partial/`, reads and writes the resume state, and promotes the folder, after a
barrier that waits for every process to be done with it; the others get the main process's outcome (or its
error). Checkpoints are still written into `.partial/` by the trainer, by whichever process it decides.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from slmsql.errors import SlmsqlError
from slmsql.inputs.data import write_json
from slmsql.runtime import distributed

STATE = "resume_state.json"


def check_free(output_dir, overwrite: bool) -> Path:
    """The output folder, refused before any slow work if something is in the way."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise SlmsqlError(f"output folder {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise SlmsqlError(f"output folder {out} exists and is not empty; pass --overwrite to replace it")
    return out


def partial_of(output_dir) -> Path:
    """The staging folder of `output_dir`: `<out>.partial`."""
    return Path(output_dir).with_name(Path(output_dir).name + ".partial")


def unfinished_run(output_dir) -> str | None:
    """The MLflow run of the unfinished work a crash left for `output_dir` (its `.partial/` resume state), or
    None: what a workflow step continues in, rather than a new run (workflow/steps.py)."""
    state = partial_of(output_dir) / STATE
    return json.loads(state.read_text(encoding="utf-8"))["run_id"] if state.is_file() else None


class Staged:
    """`with Staged(out, overwrite) as st:` write into `st.work`; on success it becomes `out` in one rename."""

    def __init__(self, output_dir, overwrite: bool = False, *, identity: dict | None = None,
                 resume: bool | None = None):
        self.out = check_free(output_dir, overwrite or bool(resume))
        self.work = partial_of(self.out)
        self.overwrite, self.resume = overwrite, resume
        self.identity = None if identity is None else json.loads(json.dumps(identity, default=str))
        self.run_id: str | None = None  # the unfinished run this one continues, if any
        self._fresh = self._bound = False  # this run made `.partial/`; a run doing the work was bound to it
        self._continues()  # a rerun with other parameters is refused here, before the stage loads any model

    @property
    def resumable(self) -> bool:
        return self.identity is not None

    def __enter__(self) -> Staged:
        # the main process prepares the folder; the others wait for it and learn the run to continue
        self.run_id = distributed.from_main(self._prepare)
        return self

    def _prepare(self) -> str | None:
        if self.work.exists():
            if not self.resumable or (self.resume is False and self.overwrite):
                shutil.rmtree(self.work)
            elif self.resume is False:
                raise SlmsqlError(f"{self.work} holds an unfinished run: pass --resume to continue it, or --overwrite")
        self._fresh = not self.work.exists()
        self.work.mkdir(parents=True, exist_ok=True)
        return self._continues()

    def _continues(self) -> str | None:
        """The unfinished run in the staging folder this one continues (None: none there); refused when it ran
        with other parameters, naming them."""
        state = self.work / STATE
        if not (self.resumable and state.exists()) or (self.resume is False and self.overwrite):
            return None
        saved = json.loads(state.read_text(encoding="utf-8"))
        then, now = saved["identity"], self.identity
        differ = ", ".join(f"{k}: {then.get(k)!r} then, {now.get(k)!r} now" for k in sorted({*then, *now})
                           if then.get(k) != now.get(k))
        if differ:
            raise SlmsqlError(f"{self.work} holds an unfinished run with other parameters ({differ}); rerun with "
                              "its parameters to finish it, or delete it to start over")
        return saved["run_id"]

    def bind(self, run_id: str) -> None:
        """Record the MLflow run doing this work, so a rerun after a crash continues it (main process)."""
        if self.resumable and distributed.is_main():
            write_json(self.work / STATE, {"identity": self.identity, "run_id": run_id})
            self._bound = True

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                distributed.barrier()  # every process is done with the folder before it moves
            except BaseException:
                self._failed()
                raise
            if distributed.is_main():
                (self.work / STATE).unlink(missing_ok=True)
                if self.out.exists():
                    shutil.rmtree(self.out)
                os.replace(self.work, self.out)
            distributed.barrier()  # and the output exists for every process that returns
        else:  # no barrier: the other processes may be gone
            self._failed()

    def _failed(self) -> None:
        # kept for a rerun only when it holds a run's work: not when the run never started (its tracking server
        # unreachable, say) in a folder this run made
        if (not self.resumable or (self._fresh and not self._bound)) and distributed.is_main():
            shutil.rmtree(self.work, ignore_errors=True)


def link_or_copy(src, dst, *, follow_symlinks=True):
    """shutil.copytree's copy_function for model weights: a hard link where the file system allows (a base model
    can be gigabytes), else a copy. Replace a linked file (unlink, then write), never write through it."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=follow_symlinks)
    return dst
