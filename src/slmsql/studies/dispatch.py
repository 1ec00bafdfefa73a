"""Where a study's cells run: here, one after another, or on a Ray cluster as tasks, each with the CPUs and GPUs
the study's budget gives a cell. Either way this process writes the records, once per cell.

On Ray a cell runs as `python -m slmsql.studies.dispatch ...` in a process group of its own, under the task: a
worker that dies (killed, out of memory, its node lost) leaves that group running, so the task's retry kills the
group its previous attempt recorded before it starts again. A cell is never trained twice at once, and no step
of a dead attempt is left behind. The workers reach the study folder, the start and the outputs by the same paths
as this process (one machine, or a shared file system: docs/stages/study.md), and track into the same MLflow store.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from slmsql.errors import SlmsqlError
from slmsql.studies import cells, records, spec
from slmsql.studies.spec import Cell, Study

log = logging.getLogger(__name__)
RETRIES = 2  # a cell's task is tried again this many times after its worker died


def here(study: Study, todo: list[Cell], start: cells.Start, s, progress, shard: str = "") -> None:
    for c in todo:
        progress(c, records.write(study, {**cells.cell(study, s, c, start), "shard": shard or None}))


def _kill_group(pgid_file: Path) -> None:
    """Kill the process group a previous attempt of this cell left (its worker died under it)."""
    try:
        os.killpg(int(pgid_file.read_text()), signal.SIGKILL)
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        pass


def cell_task(cwd: str, folder: str, cell_id: str, policy: str, band: str, workdir: str, env: dict) -> dict:
    """One cell on a Ray worker (its own process group, see the module's docstring); returns its record."""
    os.chdir(cwd)
    where = Path(workdir) / "cells" / cell_id
    where.mkdir(parents=True, exist_ok=True)
    pgid_file, out = where / "attempt.pgid", where / "record.json"
    _kill_group(pgid_file)
    out.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "slmsql.studies.dispatch", folder, cell_id, policy, band, workdir,
                             str(out)], start_new_session=True, env={**os.environ, **env})
    pgid_file.write_text(str(proc.pid))
    try:
        rc = proc.wait()
    finally:
        _kill_group(pgid_file)  # whatever its steps left running
    if rc != 0 or not out.is_file():
        raise SlmsqlError(f"cell {cell_id} failed (exit {rc}); its log is the Ray worker's")
    return json.loads(out.read_text(encoding="utf-8"))


def on_ray(study: Study, todo: list[Cell], start: cells.Start, workdir: str, address: str, progress,
           shard: str = "") -> None:
    import ray

    env = {k: v for k, v in os.environ.items() if k.startswith(("MLFLOW_", "HF_", "OMP_", "ATEN_", "SLMSQL_"))}
    ray.init(address=address or None, log_to_driver=True)
    try:
        task = ray.remote(num_cpus=study.budget["cpus_per_cell"], num_gpus=study.budget["gpus_per_cell"],
                          max_retries=RETRIES, retry_exceptions=False)(cell_task)
        pending = {task.remote(os.getcwd(), str(study.folder), c.id, start.policy, start.band, workdir, env): c
                   for c in todo}
        log.info("sent %d cell(s) to Ray at %s", len(pending), address or "a local Ray")
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            c = pending.pop(ref)
            progress(c, records.write(study, {**ray.get(ref), "shard": shard or None}))
    finally:
        ray.shutdown()


def main(argv: list[str]) -> None:
    """`python -m slmsql.studies.dispatch FOLDER CELL POLICY BAND WORKDIR OUT`: one cell, its record to OUT."""
    folder, cell_id, policy, band, workdir, out = argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    study = spec.load(folder)
    start, _ = records.read(study)
    c = next(c for c in study.cells() if c.id == cell_id)
    rec = cells.cell(study, cells.steps(study, workdir), c, cells.Start(policy, band, start))
    tmp = Path(out + ".tmp")
    tmp.write_text(json.dumps(rec), encoding="utf-8")
    tmp.rename(out)


if __name__ == "__main__":
    main(sys.argv[1:])
