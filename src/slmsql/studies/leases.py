"""Who runs what: a lease per cell (and one for the start), so that two runs of a study (two shards, a rerun beside
a running one, a retried Ray task beside its first attempt) never train the same cell at once.

A lease is an exclusive `filelock` lock on `<study>/.leases/<cell>.lock`, taken without waiting: the operating
system holds it for the process and drops it when the process ends however it ends (killed, out of memory), so
a lease is never stale and needs no expiry. Beside the lock, `<cell>.json` says who holds it (host, boot id, pid,
since when): what a refused run names. The lock is advisory and per file system: a shared file system must
support POSIX locks (NFSv4 does) for two machines to see each other's leases (docs/stages/study.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path

from filelock import FileLock, Timeout

from slmsql.errors import SlmsqlError

log = logging.getLogger(__name__)
FOLDER = ".leases"


class Busy(SlmsqlError):
    """The cell's lease is held by another process."""


def boot_id() -> str:
    """This boot of this machine (a pid means something only within one): Linux's boot id, else empty."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def me() -> dict:
    return {"host": socket.gethostname(), "boot_id": boot_id(), "pid": os.getpid()}


def _folder(study_folder) -> Path:
    folder = Path(study_folder) / FOLDER
    folder.mkdir(exist_ok=True)
    (folder / ".gitignore").write_text("*\n")  # a study folder is committed; its leases are not
    return folder


def holder(study_folder, cell: str) -> dict:
    try:
        return json.loads((Path(study_folder) / FOLDER / f"{cell}.json").read_text())
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def lease(study_folder, cell: str, wait: bool = False):
    """Hold `cell`'s lease while the block runs; Busy, naming the holder, if another process holds it (with
    `wait`: once it is free, said while waiting)."""
    folder = _folder(study_folder)
    lock = FileLock(folder / f"{cell}.lock", timeout=0)
    try:
        if wait:
            try:
                lock.acquire()
            except Timeout:
                log.info("waiting for %s's lease, held by %s", cell, holder(study_folder, cell))
                lock.acquire(timeout=-1)
        else:
            lock.acquire()
    except Timeout:
        who = holder(study_folder, cell)
        raise Busy(f"cell {cell} is being run by another process (host {who.get('host', '?')}, pid "
                   f"{who.get('pid', '?')}, since {who.get('since', '?')}): not run twice at once") from None
    try:
        info = folder / f"{cell}.json"
        tmp = folder / f".{cell}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({**me(), "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
        os.replace(tmp, info)
        yield
    finally:
        lock.release()
