"""Where a study's cells run: here, one after another, or on a Ray cluster as tasks, each with the CPUs and GPUs
the study's budget gives a cell. Either way this process writes the records, once per cell.

On Ray a cell runs as `python -m slmsql.studies.dispatch ...` in a process group of its own, under the task, and
that process holds the cell's lease (studies/leases.py) while it lives. A worker that dies (killed, out of memory,
its node lost) leaves that group running, so the task's retry kills the group its previous attempt recorded
(`attempt.pgid`: the group, its host and boot id; removed when the attempt ends) when it ran on this machine; an
attempt elsewhere that may still be alive keeps its lease, and the retry fails rather than train beside it. A cell
is never trained twice at once, and no step of a dead attempt is left behind. The workers reach the study folder,
the start and the outputs by the same paths as this process (one machine, or a shared file system:
docs/stages/study.md), and track into the same MLflow store.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from slmsql.errors import SlmsqlError
from slmsql.studies import cells, leases, records, spec
from slmsql.studies.spec import Cell, Study

log = logging.getLogger(__name__)
RETRIES = 2  # a cell's task is tried again this many times after its worker died


def here(study: Study, todo: list[Cell], start: cells.Start, s, progress, shard: str = "") -> None:
    """Each cell under its lease (studies/leases.py): one another run holds, or recorded meanwhile, is skipped."""
    for c in todo:
        try:
            with leases.lease(study.folder, c.id):
                if records.path_of(study, c.id).is_file():
                    progress(c, None, "recorded by another run meanwhile")
                    continue
                path = records.write(study, {**cells.cell(study, s, c, start), "shard": shard or None})
        except (leases.Busy, records.Lost) as e:
            progress(c, None, str(e))
            continue
        progress(c, path)


def _kill_group(pgid_file: Path) -> None:
    """Kill the process group a previous attempt of this cell left (its worker died under it), when it ran on
    this machine since its last boot (a pid names nothing elsewhere); on another machine it cannot be killed
    from here, and the cell's lease keeps this attempt from running beside it."""
    try:
        was = json.loads(pgid_file.read_text())
    except (FileNotFoundError, ValueError):
        return
    here_now = leases.me()
    if not isinstance(was, dict) or (was.get("host"), was.get("boot_id")) != (here_now["host"], here_now["boot_id"]):
        log.warning("%s: the previous attempt ran on %s; not killed from here", pgid_file, was)
        return
    try:
        pgid = int(was["pgid"])
        os.killpg(pgid, signal.SIGKILL)
        for _ in range(600):  # gone (its lease with it) before a new attempt takes the cell's lease
            if not _alive(pgid):
                return
            time.sleep(0.05)
        log.warning("%s: process group %d still there after SIGKILL", pgid_file, pgid)
    except (KeyError, ValueError, ProcessLookupError, PermissionError):
        pass


def _alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (a zombie, dead but not yet reaped, does not)."""
    import psutil

    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                return True
        except ProcessLookupError:
            continue
    return False


def cell_task(cwd: str, folder: str, cell_id: str, policy: str, band: str, workdir: str, env: dict,
              reuse: bool = True) -> dict:
    """One cell on a Ray worker (its own process group, see the module's docstring); returns its record."""
    os.chdir(cwd)
    where = Path(workdir) / "cells" / cell_id
    where.mkdir(parents=True, exist_ok=True)
    pgid_file, out = where / "attempt.pgid", where / "record.json"
    _kill_group(pgid_file)
    out.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "slmsql.studies.dispatch", folder, cell_id, policy, band, workdir,
                             str(out), str(reuse).lower()], start_new_session=True, env={**os.environ, **env})
    tmp = pgid_file.with_suffix(".tmp")  # whole or not at all: a retry reads it
    tmp.write_text(json.dumps({"pgid": proc.pid, **leases.me()}))
    os.replace(tmp, pgid_file)
    try:
        rc = proc.wait()
    finally:
        _kill_group(pgid_file)  # whatever its steps left running
        pgid_file.unlink(missing_ok=True)  # its number may name another group later
    if rc != 0 or not out.is_file():
        raise SlmsqlError(f"cell {cell_id} failed (exit {rc}); its log is the Ray worker's")
    return json.loads(out.read_text(encoding="utf-8"))


def on_ray(study: Study, todo: list[Cell], start: cells.Start, workdir: str, address: str, progress,
           shard: str = "", reuse: bool = True) -> None:
    """The cells as Ray tasks; each record written as its task returns. A cell that fails is reported and the
    others go on; the failures are raised at the end, by name."""
    import ray

    env = {k: v for k, v in os.environ.items() if k.startswith(("MLFLOW_", "HF_", "OMP_", "ATEN_", "SLMSQL_"))}
    ray.init(address=address or None, log_to_driver=True)
    failed = []
    try:
        task = ray.remote(num_cpus=study.budget["cpus_per_cell"], num_gpus=study.budget["gpus_per_cell"],
                          max_retries=RETRIES, retry_exceptions=False)(cell_task)
        pending = {task.remote(os.getcwd(), str(study.folder), c.id, start.policy, start.band, workdir, env, reuse): c
                   for c in todo}
        log.info("sent %d cell(s) to Ray at %s", len(pending), address or "a local Ray")
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            c = pending.pop(ref)
            try:
                progress(c, records.write(study, {**ray.get(ref), "shard": shard or None}))
            except records.Lost as e:
                progress(c, None, str(e))
            except Exception as e:  # noqa: BLE001 (a task's error, whatever it is: the other cells go on)
                failed.append(c.id)
                progress(c, None, f"failed: {e}")
    finally:
        ray.shutdown()
    if failed:
        raise SlmsqlError(f"{len(failed)} cell(s) failed on Ray: {', '.join(failed)} (the others are recorded)")


def main(argv: list[str]) -> None:
    """`python -m slmsql.studies.dispatch FOLDER CELL POLICY BAND WORKDIR OUT REUSE`: one cell, under its lease,
    its record to OUT."""
    folder, cell_id, policy, band, workdir, out, reuse = argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    study = spec.load(folder)
    start, _ = records.read(study)
    here = cells.fingerprint(policy, band, spec.spec_of_start(study).path)  # a zero-shot start's Hub id: its cache
    if start is None or here["fingerprint"] != start["start"]["fingerprint"]:
        raise SlmsqlError(f"the start this worker reads ({policy}, {band}) is not the one {study.folder}'s start "
                          "record names (its fingerprint): not trained from")
    c = next(c for c in study.cells() if c.id == cell_id)
    with leases.lease(study.folder, cell_id):  # held while this attempt lives: a retry never runs beside it
        rec = cells.cell(study, cells.steps(study, workdir, reuse == "true"), c, cells.Start(policy, band, start))
    tmp = Path(out + ".tmp")
    tmp.write_text(json.dumps(rec), encoding="utf-8")
    tmp.rename(out)


if __name__ == "__main__":
    main(sys.argv[1:])
