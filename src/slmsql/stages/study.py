"""`slmsql study run FOLDER` and `slmsql study report FOLDER`: a study declared in `FOLDER/study.yaml`, its cells
kept as records in `FOLDER/records/`, its report built from them (docs/stages/study.md).

run: the declaration and every record checked (a bad one refused by name before anything runs) -> the cells still
missing, of this shard -> the start (made, found or pinned; its record written once) -> each missing cell, here or
on Ray, its record written as it finishes -> the report. A crash loses no finished cell: a rerun, on this machine or
another with the records, runs only what has no record.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from slmsql.configs import StudyReportConfig, StudyRunConfig
from slmsql.errors import DataError
from slmsql.studies import cells, dispatch, leases, records, spec
from slmsql.workflow.steps import code_version

log = logging.getLogger(__name__)


def share(cell: spec.Cell, n: int) -> int:
    """The share (1..n) of --shard K/N a cell belongs to: from a stable hash of its id alone, so that a cell's
    share does not move when arms or seeds are added (by position, every later cell's would)."""
    return int(hashlib.sha256(cell.id.encode()).hexdigest()[:12], 16) % n + 1


def todo(study: spec.Study, done: dict, cfg: StudyRunConfig) -> list[spec.Cell]:
    """The missing cells this run takes: those of --cells, or of the --shard K/N share, or all."""
    declared = study.cells()
    if cfg.cells:
        refs = {records.reference_id(r) for r in study.references}
        unknown = sorted(set(cfg.cells) - {c.id for c in declared} - {records.START} - refs)
        if unknown:
            raise DataError(f"no such cell(s) {unknown}; declared: {[c.id for c in declared]}"
                            + (f", references: {sorted(refs)}" if refs else ""), "command line", field="cells")
        declared = [c for c in declared if c.id in cfg.cells]
    elif cfg.shard:
        k, n = map(int, cfg.shard.split("/"))
        declared = [c for c in declared if share(c, n) == k]
    return [c for c in declared if c.id not in done]


def references_todo(study: spec.Study, done: dict, cfg: StudyRunConfig) -> list[str]:
    """The missing references this run evaluates: those --cells names (ref-NAME), else all but on a --shard other
    than 1/N (one share takes them all: they are evaluations, minutes beside a cell)."""
    names = [r for r in study.references if r not in done]
    if cfg.cells:
        return [r for r in names if records.reference_id(r) in cfg.cells]
    return names if not cfg.shard or cfg.shard.split("/")[0] == "1" else []


def build_report(study: spec.Study, start, done: dict) -> dict:
    """The study's report from its records: the start's, the cells' (`done`) and the references' (read here)."""
    from slmsql.studies import report as reporting

    refs = records.references(study, start)
    return reporting.build(study.as_dict(), start, [done[c.id] for c in study.cells() if c.id in done],
                           [refs[r] for r in study.references if r in refs])


def write_report(study: spec.Study, start, done: dict) -> dict:
    from slmsql.studies import report as reporting  # matplotlib: loaded only when a report is written

    rep = build_report(study, start, done)
    reporting.write(study.folder, rep)
    return rep


def run(cfg: StudyRunConfig) -> dict:
    study = spec.load(cfg.study)
    spec.check_files(study)
    start, done = records.read(study)  # every record checked before anything runs
    if start is not None:  # a start recorded before the declaration was bound to it: bound now (binding.py)
        start = records.bind(study, start)
    work, refs = todo(study, done, cfg), references_todo(study, records.references(study, start), cfg)
    if start is not None and (work or refs) and code_version() not in study.accepted_code(start["code_version"]):
        raise DataError(f"this code ({code_version()}) is not one the study accepts "
                        f"({sorted(study.accepted_code(start['code_version']))}): its cells would not pool. To "
                        "continue with it, add it under continue_with with the reason (docs/stages/study.md)",
                        study.path, field="continue_with")
    print(f"study {study.name}: {len(done)} of {len(study.cells())} cells recorded; this run: "
          f"{len(work)} cell(s){' and the start' if start is None else ''}"
          + (f", {len(refs)} reference(s)" if refs else ""), flush=True)
    workdir = cfg.output_dir or str(Path("outputs") / "studies" / study.name)
    s = cells.steps(study, workdir, cfg.reuse)
    with leases.lease(study.folder, records.START, wait=True):  # one run makes (and pins) the start; the others
        if start is None:                                         # wait for it and take it
            start, _ = records.read(study)
        st = cells.start(study, s, start)
    finished, passed = [], []

    def progress(c: spec.Cell, path: Path | None, why: str = "") -> None:
        if path is None:  # not run or not recorded here: another run has it, or it failed
            passed.append(c.id)
            print(f"cell {c.id} not recorded by this run: {why}", flush=True)
            return
        finished.append(c.id)
        print(f"[{len(finished)}/{len(work)}] cell {c.id} recorded: {path}", flush=True)

    for name in refs:  # here, under their leases, as cells are (a reference is one evaluation per eval set)
        rid = records.reference_id(name)
        try:
            with leases.lease(study.folder, rid):
                if records.path_of(study, rid).is_file():
                    print(f"reference {name} not evaluated by this run: recorded by another run meanwhile", flush=True)
                    continue
                path = records.write(study, {**cells.reference(study, s, name, st), "shard": cfg.shard or None})
        except (leases.Busy, records.Lost) as e:
            print(f"reference {name} not recorded by this run: {e}", flush=True)
            continue
        print(f"reference {name} recorded: {path}", flush=True)
    if cfg.ray_address:
        dispatch.on_ray(study, work, st, workdir, cfg.ray_address, progress, cfg.shard, cfg.reuse)
    else:
        dispatch.here(study, work, st, s, progress, cfg.shard)
    start, done = records.read(study)
    if cfg.report:
        write_report(study, start, done)
        print(f"report: {study.folder / 'report.md'}", flush=True)
    left = records.missing(study, done)
    print(f"study {study.name}: {len(done)} of {len(study.cells())} cells recorded"
          + (f"; missing: {', '.join(c.id for c in left)}" if left else ""), flush=True)
    return {"recorded": sorted(done), "missing": [c.id for c in left], "ran": finished}


def report(cfg: StudyReportConfig) -> dict:
    study = spec.load(cfg.study)
    start, done = records.read(study)
    rep = write_report(study, start, done)
    print((study.folder / "report.md").read_text(encoding="utf-8"), flush=True)
    return rep
