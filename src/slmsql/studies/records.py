"""A study's records: `records/start.json` (the start: its fingerprint, how it was made, its own results on every
eval set) and one `records/<cell>.json` per finished cell (its config, the start's fingerprint, the code version,
the float path, right or wrong and a hash of the SQL per question and eval set, its headline metrics and MLflow
run ids). Records are what a user commits or copies: a study's report is built from them alone.

Reading them is strict. A record that is not JSON, names another study or cell, carries a config other than the
declaration's, comes from another start (fingerprint) or from code the study does not accept is refused by its
file name, before anything runs or any report is written: never pooled, never overwritten.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from slmsql import configs
from slmsql.configs import EvaluateConfig, GRPOStageConfig
from slmsql.errors import DataError, SlmsqlError
from slmsql.studies import binding, diagnosis
from slmsql.studies.binding import sha256_file  # noqa: F401  (cells.inputs reads files with it too)
from slmsql.studies.spec import REFERENCE, Cell, Study

SCHEMA = "slmsql.study-record/1"
START = "start"
WEIGHTS = ("*.safetensors", "*.bin")  # a policy folder's weights: a LoRA adapter's or a whole model's


def fingerprint(policy, band) -> dict:
    """The start's identity: sha256 of its weights files (a LoRA adapter's, or a whole model's; checkpoints
    aside) and of its band file, and one digest of both."""
    files = sorted(f for pattern in WEIGHTS for f in Path(policy).glob(pattern))
    if not files:
        raise DataError("no weights (*.safetensors, *.bin) in the start's policy folder", policy)
    weights = hashlib.sha256("".join(f"{f.name}\0{sha256_file(f)}\n" for f in files).encode()).hexdigest()
    band_sha = sha256_file(band)
    return {"fingerprint": hashlib.sha256(f"{weights}\0{band_sha}".encode()).hexdigest(),
            "policy_sha256": weights, "band_sha256": band_sha}


def float_path() -> dict:
    """What decides this machine's floats: torch's version and CPU kernels, the thread count, the device."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY", ""),
            "threads": os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads())),
            "device": gpu or f"cpu ({platform.machine()})"}


def sql_hash(sql) -> str:
    return hashlib.sha256(str(sql or "").encode("utf-8", "surrogatepass")).hexdigest()[:16]


def results(rows, match: str) -> dict:
    """results.jsonl rows -> {question id: [correct, sql hash]}, the rows EX counts only: under test-suite a
    question whose gold cannot be judged on its suite is left out, as evaluate leaves it out of n (it is never a
    wrong answer)."""
    from slmsql.sql.scoring import split_scored

    return {str(r["id"]): [bool(r["correct"]), sql_hash(r.get("predicted_sql"))] for r in split_scored(rows, match)[0]}


def make(study: Study, cell: str, *, config: dict, start: dict, code_version: str, results: dict, metrics: dict,
         runs: dict, arm=None, seed=None, diagnosis: dict | None = None) -> dict:
    """A record; a cell's carries its GRPO run's `diagnosis` (studies/diagnosis.py), the start's the declaration
    it binds (studies/binding.py)."""
    bound = {binding.KEY: binding.normalised(study)} if cell == START else {}
    return {**bound, "schema": SCHEMA, "study": study.name, "cell": cell, "arm": arm, "seed": seed, "config": config,
            "start": start, "code_version": code_version, "float_path": float_path(), "results": results,
            "metrics": metrics, "mlflow": runs, **({"diagnosis": diagnosis} if diagnosis is not None else {}),
            "finished_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def path_of(study: Study, cell: str) -> Path:
    return study.records / f"{cell}.json"


class Lost(SlmsqlError):
    """Another run wrote this record first: this one's result is not recorded."""


def write(study: Study, record: dict) -> Path:
    """Write a record whole or not at all (a temporary file linked to its name, which fails if the name exists:
    an existing record is never replaced, so a cell finished twice counts once). The run that finds the record
    there loses: Lost says so, for the caller to report (not "recorded")."""
    path = path_of(study, record["cell"])
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{record['cell']}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # a file to commit and share, not mkstemp's private 0600
        os.link(tmp, path)  # fails if the record exists: first writer wins
    except FileExistsError:
        raise Lost(f"{path}: written by another run first; this run's result for {record['cell']} is not "
                   "recorded") from None
    finally:
        os.unlink(tmp)
    return path


_OBJECT = {"type": "object"}
# What a record holds, checked before any of it is read (a record is data a user may have edited or copied)
RECORD = {
    "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
    "required": ["schema", "study", "cell", "config", "start", "code_version", "float_path", "results", "metrics"],
    "properties": {
        "schema": {"type": "string"}, "study": {"type": "string"}, "cell": {"type": "string"},
        "arm": {"type": ["string", "null"]}, "seed": {"type": ["integer", "null"]},
        "config": _OBJECT, "start": {"type": "object", "required": ["fingerprint"],
                                    "properties": {"fingerprint": {"type": "string"}}},
        "code_version": {"type": "string"}, "float_path": _OBJECT, "metrics": _OBJECT, "mlflow": _OBJECT,
        "results": {"type": "object", "additionalProperties": {  # {eval set: {question id: [correct, sql hash]}}
            "type": "object", "additionalProperties": {
                "type": "array", "minItems": 2, "maxItems": 2,
                "prefixItems": [{"type": "boolean"}, {"type": ["string", "null"]}]}}},
        "diagnosis": _OBJECT,  # its figures: _check_diagnosis
        "declaration": {"type": "object", "required": ["sha256"], "properties": {"sha256": {"type": "string"}}},
        "shard": {"type": ["string", "null"], "pattern": "^[0-9]+/[0-9]+$"},
        "finished_at": {"type": "string"}}}


def _validate(rec, path: Path) -> None:
    """`rec` against RECORD: the first error refused naming its field (a missing key: that key)."""
    import jsonschema

    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(RECORD).iter_errors(rec))
    if error is None:
        return
    where = [str(p) for p in error.absolute_path]
    if error.validator == "required":
        missing = next(k for k in error.validator_value if k not in error.instance)
        raise DataError("corrupt record: key missing", path, field=".".join([*where, missing]))
    if not isinstance(rec, dict):
        raise DataError("corrupt record (not a JSON object)", path)
    raise DataError(f"corrupt record: {error.message}", path, field=".".join(where) or None)


def _read(path: Path, study: Study, cell: str) -> dict:
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"corrupt record (not UTF-8: {e.reason})", path) from None
    except json.JSONDecodeError as e:
        raise DataError(f"corrupt record (not JSON: {e.msg})", path, e.lineno) from None
    _validate(rec, path)
    for key, want in (("schema", SCHEMA), ("cell", cell)):
        if rec[key] != want:
            raise DataError(f"expected {want!r}, got {rec[key]!r}", path, field=key)
    if "diagnosis" in rec:  # optional: records from before it have none, and the report says "not recorded"
        _check_diagnosis(rec["diagnosis"], path)
    return rec


def _check_diagnosis(d, path: Path) -> None:
    before = set(diagnosis.KEYS) - set(diagnosis.TELEMETRY)  # a record made before the telemetry was kept
    if not isinstance(d, dict) or set(d) not in (set(diagnosis.KEYS), before):
        raise DataError(f"corrupt record: expected an object of {list(diagnosis.KEYS)}", path, field="diagnosis")
    for key, value in d.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise DataError(f"corrupt record: expected a number or null, got {value!r}", path,
                            field=f"diagnosis.{key}")


@functools.cache
def _defaults(cls) -> dict:
    """A stage's default options as params (built once: read() checks every record against them)."""
    return configs.to_params(cls())


def _with_new_defaults(recorded: dict, declared: dict) -> dict:
    """A cell record's config with each GRPO or evaluate option it lacks taken from the declaration where the
    declaration leaves it at its default: an option added to a stage after the record was made, at its default,
    is what the record's code did (a new option's default keeps the old behaviour). Any other difference still
    refuses the record; its code version is checked apart (`Study.accepted_code`)."""
    out = dict(recorded)
    for section, cls in (("grpo", GRPOStageConfig), ("evaluate", EvaluateConfig)):
        have, want = recorded.get(section), declared.get(section)
        if isinstance(have, dict) and isinstance(want, dict):
            default = _defaults(cls)
            out[section] = {**have, **{k: v for k, v in want.items() if k not in have and default.get(k) == v}}
    return out


def _differs(want: dict, got: dict) -> str:
    keys = sorted(set(want) | set(got), key=str)
    k = next(k for k in keys if want.get(k) != got.get(k))
    if isinstance(want.get(k), dict) and isinstance(got.get(k), dict):
        return f"{k}.{_differs(want[k], got[k])}"
    return f"{k} (declared {want.get(k)!r}, recorded {got.get(k)!r})"


def read(study: Study) -> tuple[dict | None, dict[str, dict]]:
    """The start record (or None) and every cell record by cell id, each checked against the declaration.
    A file in records/ that names no declared cell is refused too: a typo would otherwise be a silent gap."""
    declared = {c.id: c for c in study.cells()}
    start = None
    if path_of(study, START).is_file():
        start = _read(path_of(study, START), study, START)
    # the study its records name: the start's (a folder may be renamed; its records keep the name they were made
    # under), and every cell's the same
    study_name = start["study"] if start is not None else study.name
    if start is not None:
        if start["config"] != study.start_config():
            raise DataError(f"the start was made otherwise than study.yaml declares: "
                            f"{_differs(study.start_config(), start['config'])}", path_of(study, START), field="config")
        binding.check(study, start, path_of(study, START))
    cells = {}
    refs = {reference_id(name) for name in study.references}
    for path in sorted(study.records.glob("*.json")) if study.records.is_dir() else []:
        name = path.stem
        if name == START or name in refs:  # a reference's record: `references`
            continue
        if name not in declared:
            raise DataError(f"a record for no declared cell (declared: {sorted(declared)}; references: "
                            f"{sorted(refs)})", path)
        cells[name] = _checked(study, start, study_name, path, name, study.cell_config(declared[name]))
    return start, cells


def reference_id(name: str) -> str:
    return f"{REFERENCE}{name}"


def references(study: Study, start: dict | None) -> dict[str, dict]:
    """Every declared reference's record (by reference name) that is there, checked as a cell's is."""
    out = {}
    study_name = start["study"] if start is not None else study.name
    for name in study.references:
        path = path_of(study, reference_id(name))
        if path.is_file():
            out[name] = _checked(study, start, study_name, path, reference_id(name), study.reference_config(name))
    return out


def _checked(study: Study, start: dict | None, study_name: str, path: Path, name: str, want: dict) -> dict:
    """A cell's or reference's record, refused unless it is the declared one, from the study's start and code."""
    rec = _read(path, study, name)
    if rec["study"] != study_name:
        raise DataError(f"expected {study_name!r} (the study its start's record names), got {rec['study']!r}",
                        path, field="study")
    if (got := _with_new_defaults(rec["config"], want)) != want:
        raise DataError(f"config differs from the declaration: {_differs(want, got)}", path, field="config")
    if start is None:
        raise DataError("a record without records/start.json: the start (and the questions) it belongs to are "
                        "unknown", path)
    if rec["start"].get("fingerprint") != start["start"]["fingerprint"]:
        raise DataError(f"from another start (fingerprint {rec['start'].get('fingerprint', '?')[:12]}, the "
                        f"study's {start['start']['fingerprint'][:12]}): never pooled", path, field="start")
    accepted = study.accepted_code(start["code_version"])
    if rec["code_version"] not in accepted:
        raise DataError(f"made by code {rec['code_version']}, which the study does not accept "
                        f"({sorted(accepted)}): never pooled silently. To pool it, add it under continue_with "
                        f"in {study.path} with the reason (docs/stages/study.md)", path, field="code_version")
    return rec


def bind(study: Study, start: dict) -> dict:
    """A start record made before the declaration was bound to it, with the declaration as it is now added (once,
    whole: its other keys as they were); any other record as it is (studies/binding.py)."""
    if binding.KEY in start:
        return start
    rec = {**start, binding.KEY: binding.normalised(study)}
    path = path_of(study, START)
    tmp = path.with_name(f".{START}.bind.tmp")
    tmp.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return rec


def missing(study: Study, cells: dict) -> list[Cell]:
    return [c for c in study.cells() if c.id not in cells]
