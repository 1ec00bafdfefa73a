"""The work of a study: its start (SFT, filter, the start's own evaluations) and its cells (GRPO, then evaluate on
every eval set), each step an MLflow run made or reused by `workflow.Steps`, each finished unit written as a record.

The start is found, in this order: pinned in the study folder (`start/policy`, `start/band.jsonl`; checked against
its record's fingerprint), else made on this machine (its steps reused from this MLflow store when they ran before)
and checked against the record if there is one. A start that differs from the record's is refused: its cells
could not pool with the recorded ones.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import shutil
from pathlib import Path

from slmsql import configs
from slmsql.configs import GRPOStageConfig
from slmsql.errors import DataError, SlmsqlError
from slmsql.inputs.data import questions, read_jsonl, write_jsonl
from slmsql.studies import diagnosis, records, spec
from slmsql.studies.spec import BAND, SECTIONS, Cell, Study
from slmsql.workflow.steps import Steps, code_version, project_path, use_this_cli

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Start:
    policy: str  # a local folder: a LoRA adapter on the study's model, or a whole model
    band: str
    record: dict


def steps(study: Study, workdir, reuse: bool = True) -> Steps:
    import mlflow

    from slmsql.tracking import runs as tracking

    tracking.configure()
    use_this_cli()  # each step is `mlflow run` of this checkout's MLproject, calling this environment's slmsql
    experiment = mlflow.set_experiment(study.experiment)
    return Steps(experiment.experiment_id, output_dir=workdir, experiment=study.experiment, reuse=reuse)


def _section(name: str, section: dict) -> dict:
    """A section's options as step parameters, its recipes resolved here (a step's params say what it ran), less
    what the study sets itself (a model's recipe names its model: the study's start says which)."""
    cls, owned = SECTIONS[name]
    values = {k: v for k, v in section.items() if k != "recipe"}
    cfg = configs.load(cls, ",".join(section.get("recipe", [])) or None, values, require=False)
    given = set(values) | {k for p in section.get("recipe", []) for k in configs.recipe_values(cls, p)}
    out = {k: configs.param_text(getattr(cfg, k)) for k in (given | set(PATHS) & _names(cls)) - set(owned)}
    # files as the steps find them (they run in the project folder, wherever this ran from), defaults too
    return {k: _path(v) if k in PATHS else v for k, v in out.items() if v or k in given}


PATHS = ("data", "db_root", "tables_json")  # a section's fields naming files


def _names(cls) -> set[str]:
    return {f.name for f in configs.fields(cls)}


def _loads(study: Study, policy: str, adapter_key: str) -> dict:
    """How a step loads the start: a LoRA adapter on the study's base model, or a whole model folder."""
    if (Path(policy) / "adapter_config.json").is_file():
        return {"model": _path(study.model), adapter_key: project_path(policy)}
    return {"model": _path(policy)}  # a whole model: a folder, or a zero-shot start's Hub id


def _path(p: str) -> str:
    return project_path(p) if Path(p).exists() else p  # a Hub id as given


def _pin(study: Study, policy: str, band: str) -> None:
    """Copy the start's files (its policy folder's top-level files, checkpoints aside, and its band; a zero-shot
    start's band alone: its policy is the model, named by Hub id or path) into the study folder, whole or not at
    all."""
    tmp = study.folder / ".start.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if not study.zero_shot:
        (tmp / "policy").mkdir()
        for f in Path(policy).iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / "policy" / f.name)
    shutil.copy2(band, tmp / "band.jsonl")
    tmp.rename(study.pinned)


def _pinned(study: Study) -> tuple[str, str] | None:
    """The (policy, band) pinned in `study`'s folder, or None when it holds none."""
    policy, band = study.pinned / "policy", study.pinned / "band.jsonl"
    if not band.is_file() or not (study.zero_shot or policy.is_dir()):
        return None
    return (study.model if study.zero_shot else str(policy)), str(band)


def fingerprint(policy: str, band: str, declared: Path) -> dict:
    """records.fingerprint of a policy folder, or of the files a Hub id names in this machine's cache (a zero-shot
    start's model: its weights are hashed, not its name)."""
    if not Path(policy).exists():
        from huggingface_hub import snapshot_download

        try:
            policy = snapshot_download(policy, local_files_only=True)
        except Exception as e:  # not in the cache, or not a repo id: huggingface_hub's errors vary
            raise DataError(f"the start's model {policy!r} is neither a folder nor in this machine's Hugging Face "
                            f"cache ({type(e).__name__}): put it there first (docs/real-model.md)", declared,
                            field="start.model") from None
    return records.fingerprint(policy, band)


SAMPLE_SEED = 0  # an unfiltered arm's questions: drawn once per start, the same for every seed (as the band is)


def training_data(study: Study, arm: str, st: Start, out: Path) -> str:
    """The file arm `arm` trains on: the start's band, or (train_on: sample) as many of the filter's own source
    questions drawn at random, unfiltered (every pass-rate bucket), written to `out`."""
    if study.train_on.get(arm) != "sample":
        return st.band
    src = spec.spec_of_start(study)  # start.from: the other study's filter
    cfg = src.filter_config()
    pool = questions(spec.found(cfg.data), cfg.db_ids, cfg.limit)
    n = len(read_jsonl(st.band))
    if n > len(pool):
        raise DataError(f"the band has {n} questions, its source only {len(pool)}", src.path, field="band")
    chosen = set(random.Random(SAMPLE_SEED).sample(range(len(pool)), n))
    path = out / "train-sample.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(path, [e.to_json() for i, e in enumerate(pool) if i in chosen])  # in source order
    return str(path)


def _eval(s: Steps, study: Study, name: str, loads: dict, band: str, tags: dict, out: Path) -> dict:
    runs = {}
    for es in study.eval_sets:
        data = band if es.data == BAND else es.data
        runs[es.name] = s.run("evaluate", f"eval {es.name} {name}", tags=tags, output_dir=str(out / f"eval-{es.name}"),
                              **loads, data=project_path(data), db_root=project_path(es.db_root),
                              **({"db_ids": ",".join(es.db_ids)} if es.db_ids else {}),
                              dataset_name=es.name, alpha=str(study.alpha), **_section("evaluate", study.evaluate))
    return runs


def _results(s: Steps, runs: dict) -> dict:
    return {name: records.results(read_jsonl(s.artifact(run, "results.jsonl")), run.data.params.get("match", "bird"))
            for name, run in runs.items()}


def inputs(study: Study, band: str) -> dict:
    """sha256 of each eval set's file: a start's evaluations hold only while the files are the same."""
    return {es.name: records.sha256_file(band if es.data == BAND else es.data) for es in study.eval_sets}


def start(study: Study, s: Steps, known: dict | None) -> Start:
    """The study's start (made, found or pinned), and its record: written here when there was none."""
    pinned = _pinned(study)
    tags = {"slmsql.study": study.name, "slmsql.cell": records.START}
    if study.start_from:  # another study's pinned start, checked against that study's record
        other = spec.load(study.start_from)
        theirs, _ = records.read(other)
        pinned = _pinned(other)
        if theirs is None or pinned is None:
            raise DataError(f"start.from {other.folder}: that study's start is not recorded and pinned yet (run "
                            f"`slmsql study run {other.folder} --cells start` with start.pin: true)", study.path,
                            field="start.from")
        if fingerprint(*pinned, other.path)["fingerprint"] != theirs["start"]["fingerprint"]:
            raise DataError("pinned start's files do not match its record's fingerprint", other.pinned)
    if pinned:
        (policy, band), made = pinned, {}
    else:
        made = {}
        if study.sft is not None:
            made["sft"] = s.run("sft", "start sft", tags=tags, output_dir=str(s.out / "start" / "sft"),
                                **_section("sft", study.sft), model=_path(study.model),
                                db_root=project_path(study.db_root))  # its data's schemas are the study's databases
            policy = s.artifact(made["sft"], "policy")
        else:
            policy = study.adapter or study.model  # a given start, or the model zero-shot
        made["filter"] = s.run("filter", "start filter", tags=tags, output_dir=str(s.out / "start" / "filter"),
                               **_section("band", study.band), **_loads(study, policy, "adapter"),
                               db_root=project_path(study.db_root))
        band = s.artifact(made["filter"], "band.jsonl")
    fp = fingerprint(policy, band, spec.spec_of_start(study).path)
    where = "pinned in " + str(study.pinned) if not made else "made on this machine"
    if known is not None:
        if fp["fingerprint"] != known["start"]["fingerprint"]:
            raise DataError(f"the start {where} (fingerprint {fp['fingerprint'][:12]}) is not the one the study's "
                            f"records come from ({known['start']['fingerprint'][:12]}): its cells could not pool. "
                            "Pin the recorded start (start.pin: true, commit the study's start/ folder) to continue "
                            "on another machine", records.path_of(study, records.START), field="start")
        if (now := inputs(study, band)) != known["metrics"].get("inputs", now):
            raise DataError("an eval set's file differs from the one the start was evaluated on: "
                            f"{sorted(k for k in now if now[k] != known['metrics']['inputs'].get(k))}",
                            records.path_of(study, records.START), field="metrics.inputs")
        return Start(policy, band, known)
    if study.pin and made:
        _pin(study, policy, band)
        policy, band = _pinned(study)
    evals = _eval(s, study, "start", _loads(study, policy, "adapter"), band, tags, s.out / "start")
    res = _results(s, evals)
    filt = made.get("filter")
    metrics = {"inputs": inputs(study, band), "band": len(read_jsonl(band)),
               **{f"{k}/ex": sum(c for c, _ in v.values()) / max(len(v), 1) for k, v in res.items()},
               **({f"filter/{k}": v for k, v in filt.data.metrics.items()} if filt else {})}
    rec = records.make(study, records.START, config=study.start_config(), start=fp, code_version=s.version,
                       results=res, metrics=metrics,
                       runs={**{f"{k}_run": r.info.run_id for k, r in made.items()},
                             "eval_runs": {k: r.info.run_id for k, r in evals.items()}})
    records.write(study, rec)
    return Start(policy, band, rec)


def reference(study: Study, s: Steps, name: str, st: Start) -> dict:
    """Evaluate one reference (a policy the study does not train: a base model zero-shot, say) on every eval set,
    the start's band included; its record (not written: the caller writes it, once)."""
    rid = records.reference_id(name)
    ref = study.references[name]
    loads = {"model": _path(ref["model"]), **({"adapter": project_path(ref["adapter"])} if ref["adapter"] else {})}
    tags = {"slmsql.study": study.name, "slmsql.cell": rid}
    evals = _eval(s, study, rid, loads, st.band, tags, s.out / "references" / name)
    res = _results(s, evals)
    return records.make(study, rid, config=study.reference_config(name), start=st.record["start"],
                        code_version=s.version, results=res,
                        metrics={f"{k}/ex": sum(x for x, _ in v.values()) / max(len(v), 1) for k, v in res.items()},
                        runs={"eval_runs": {k: r.info.run_id for k, r in evals.items()}})


def cell(study: Study, s: Steps, c: Cell, st: Start) -> dict:
    """Train and evaluate one cell; its record (not written: the caller writes it, once)."""
    if code_version() not in study.accepted_code(st.record["code_version"]):
        raise SlmsqlError(f"this code ({code_version()}) is not one {study.path} accepts "
                          f"({sorted(study.accepted_code(st.record['code_version']))}): its cells would not pool. "
                          "To continue the study with it, add it under continue_with with the reason "
                          "(docs/stages/study.md)")
    out = s.out / "cells" / c.id
    tags = {"slmsql.study": study.name, "slmsql.cell": c.id, "slmsql.variant": c.arm, "slmsql.seed": c.seed}
    grpo_params = {k: configs.param_text(v) for k, v in dataclasses.asdict(study.grpo_config(c.arm)).items()
                   if k not in configs.SWEEP_OWNED}
    data = training_data(study, c.arm, st, out)
    grpo = s.run("grpo", f"grpo {c.id}", tags=tags, output_dir=str(out / "grpo"), seed=c.seed, **grpo_params,
                 **_loads(study, st.policy, "base_adapter"), data=project_path(data),
                 db_root=project_path(study.db_root), experiment=study.experiment)
    model = _loads(study, st.policy, "adapter")["model"]
    evals = _eval(s, study, c.id, {"model": model, "adapter": s.uri(grpo, "adapter")}, st.band, tags, out)
    res = _results(s, evals)
    metrics = {**{k: v for k, v in grpo.data.metrics.items() if k in GRPOStageConfig.key_metrics},
               **{f"{k}/ex": sum(x for x, _ in v.values()) / max(len(v), 1) for k, v in res.items()}}
    # why it gained or did not, from the files its GRPO step left in its output folder (a step reused from this
    # store wrote the same folder)
    why = diagnosis.of_run(out / "grpo", {str(r["id"]): r for r in read_jsonl(data)})
    if not why["logged_steps"]:
        log.warning("cell %s: no training log in %s: its diagnosis is empty", c.id, out / "grpo")
    return records.make(study, c.id, config=study.cell_config(c), start=st.record["start"], code_version=s.version,
                        results=res, metrics=metrics, arm=c.arm, seed=c.seed, diagnosis=why,
                        runs={"grpo_run": grpo.info.run_id, "eval_runs": {k: r.info.run_id for k, r in evals.items()}})
