"""The declaration bound to its records: what a study's verdicts depend on besides its cells' configs (the Holm
family, alpha, each eval set's file and databases, the study's databases), normalised and hashed into the start's
record (`declaration`). A declaration that differs from the recorded one is refused, naming what changed, unless
`amendments:` in study.yaml accepts the new declaration's hash with a reason and a date; the report lists them.

A file's hash is checked where the file is (always on `study run`, which needs them all); where it is not (a report
made from the records alone on another machine), the recorded hash stands in for it if its path is unchanged.

A start record made before this binding has no `declaration`: `study run` binds the declaration as it then is and
adds it to that record, once (its other keys unchanged); `study report` reads such a record as unbound and says so.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from slmsql.errors import DataError
from slmsql.studies.spec import BAND, Study

KEY = "declaration"


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tree_sha256(folder) -> str:
    """One hash of the databases a study reads under a folder: each `*.sqlite` file's path inside it and its bytes
    (a test suite is every *.sqlite of <db_id>/). Other files are not read by any stage, and a suite's manifest
    and check reports hold build times, which would make one machine's `make spider` refuse another's records."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*.sqlite") if p.is_file())
    return hashlib.sha256("".join(f"{p.relative_to(folder).as_posix()}\0{sha256_file(p)}\n"
                                  for p in files).encode()).hexdigest()


def _digest(norm: dict) -> str:
    body = {k: v for k, v in norm.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def normalised(study: Study, recorded: dict | None = None) -> dict:
    """The declaration's parts that decide what the records mean, with the hash of its files and of itself. A
    file absent here takes the hash `recorded` gives for the same path (None if none)."""
    old = recorded or {}

    def sha(path: str, folder: bool, was: dict | None) -> str | None:
        if Path(path).is_dir() if folder else Path(path).is_file():
            return tree_sha256(path) if folder else sha256_file(path)
        was = was or {}
        return was.get("sha256") if was.get("path") == path else None

    old_sets = {es.get("name"): es for es in old.get("eval_sets", []) if isinstance(es, dict)}
    sets = []
    for es in study.eval_sets:
        was = old_sets.get(es.name, {})
        data = {"path": BAND} if es.data == BAND else {"path": es.data,
                                                         "sha256": sha(es.data, False, was.get("data"))}
        sets.append({"name": es.name, "data": data,
                     "db_root": {"path": es.db_root, "sha256": sha(es.db_root, True, was.get("db_root"))},
                     **({"db_ids": sorted(es.db_ids)} if es.db_ids else {})})  # a split: which questions
    norm = {"alpha": study.alpha, "comparisons": study.comparisons, "eval_sets": sets,
            "db_root": {"path": study.db_root, "sha256": sha(study.db_root, True, old.get("db_root"))}}
    return {**norm, "sha256": _digest(norm)}


def _changes(want, got, prefix="") -> list[str]:
    """The dotted names of what differs between two normalised declarations (an eval set by its name)."""
    if prefix == "eval_sets." and isinstance(want, list) and isinstance(got, list):
        want, got = ({x.get("name"): x for x in side if isinstance(x, dict)} for side in (want, got))
    if isinstance(want, dict) and isinstance(got, dict):
        keys = sorted(set(want) | set(got), key=str)  # the top level's own hash aside: its parts name the change
        return [c for k in keys if prefix or k != "sha256" for c in _changes(want.get(k), got.get(k), f"{prefix}{k}.")]
    return [] if want == got else [prefix.rstrip(".")]


def check(study: Study, start: dict, path) -> dict | None:
    """The declaration as it is now, checked against the one bound into `start` (the start's record at `path`):
    the same, or an amendment accepts its hash; else refused by name. None for a record made before the binding."""
    recorded = start.get(KEY)
    if recorded is None:
        return None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("sha256"), str):
        raise DataError("corrupt record: expected the bound declaration's object with its sha256", path, field=KEY)
    now = normalised(study, recorded)
    if now["sha256"] == recorded["sha256"] or any(now["sha256"].startswith(a["declaration"])
                                                  for a in study.amendments):
        return now
    changed = _changes(now, recorded) or ["(its hash)"]
    unknown = [c for c in changed if c.endswith(".sha256") and _at(now, c) is None]
    raise DataError(
        f"{study.path} differs from the declaration its records were made under: {', '.join(changed)}"
        + (f" (not here to hash: {', '.join(unknown)})" if unknown else "")
        + f". A change after the first record needs an amendment: add under amendments: {{declaration: "
          f"'{now['sha256'][:16]}', reason: why, date: YYYY-MM-DD}} (docs/stages/study.md)", path, field=KEY)


def _at(norm: dict, dotted: str):
    node = norm
    for part in dotted.split("."):
        if isinstance(node, list):
            node = next((x for x in node if isinstance(x, dict) and x.get("name") == part), None)
        elif isinstance(node, dict):
            node = node.get(part)
        else:
            return None
    return node
