"""MLflow 3's model-centric lineage: each trained policy is a LoggedModel, made by the run that trained it, and
each evaluation's EX is a metric of that model on its eval set (the experiment's Models tab).

Its tag `slmsql.files` names the run artifact that holds the policy's files (`runs:/<training run>/policy` or
`.../adapter`), which every stage loads by that URI. An adapter (a few megabytes) is also copied into the model's
own artifacts when its run ends; a full model stays a reference, said in the description. The model's params are
its run's that define it (not configs.RUN_ONLY: where and how it ran). Its description (`describe_model`, the
tag MLflow's UI shows on a LoggedModel's page, as on a run's: the page shows no tags) says what it is, which run
trained it on what, where its files are, its slmsql tags, and its EX per eval set, rewritten whenever a run uses
it or an evaluation logs EX to it. `publish` later
logs the servable text2sql model into the GRPO policy's LoggedModel and registers it (text2sql.log_text2sql), so
the registry's version, the model and the training run are one line. The training run carries the model's id as
the tag `slmsql.logged_model`, by which an evaluation finds the model of the policy it scored.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path

from slmsql.tracking import runs as tracking

log = logging.getLogger(__name__)

MODEL_TAG = "slmsql.logged_model"  # on a training run: the id of the LoggedModel of the policy it trained
FILES_TAG = "slmsql.files"  # on a LoggedModel: the run artifact holding its files (runs:/<run id>/<path>)
DIGEST_TAG = "slmsql.digest"  # on an external model of a folder: what its files held (`digest`)
KIND_TAG = "slmsql.policy_kind"  # on a policy's LoggedModel: adapter (its files copied into the model) or full
TYPE = "text2sql-policy"
# An evaluation's metrics that are its model's on that eval set: EX, one column per eval set in the Models tab (each
# metric there is a 200 px column per eval set); its interval, counts and paired test stay the evaluation run's.
MODEL_METRICS = ("ex",)
NOT_IN_NAMES = re.compile(r"[/:.%\"']")  # what MLflow refuses in a LoggedModel's name (a sweep cell: runs_tier=0.1)


def model_name(run_name: str) -> str:
    """The run's name as a LoggedModel may be named: each character MLflow refuses there becomes '_'."""
    return NOT_IN_NAMES.sub("_", run_name)


def start_policy_model(run_id: str, name: str, files: str, adapter: bool = True) -> str:
    """The LoggedModel (PENDING) of the policy run `run_id` is training, an output of that run, with the run's
    params that define it, its files named by `files` (an artifact path of the run; `adapter`: a PEFT adapter,
    which the stage also copies into the model, else a full model), and its description. The run's end finalizes
    it (durable.Outbox.track_model). A resumed run keeps the model it started with. Needs the server: called
    where the run has just started."""
    import mlflow
    from mlflow.entities import LoggedModelOutput

    from slmsql.configs import RUN_ONLY

    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    if (have := run.data.tags.get(MODEL_TAG)):
        return have
    model = client.create_logged_model(
        run.info.experiment_id, name=model_name(name), source_run_id=run_id, model_type=TYPE,
        tags={FILES_TAG: f"runs:/{run_id}/{files}", "slmsql.stage": run.data.tags.get("slmsql.stage", ""),
              KIND_TAG: "adapter" if adapter else "full"},
        params={k: v[:6000] for k, v in run.data.params.items() if k.split(".")[0] not in RUN_ONLY})
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])
    client.set_tag(run_id, MODEL_TAG, model.model_id)
    describe_model(model.model_id)
    return model.model_id


STAGE_NAMES = {"sft": "SFT", "grpo": "GRPO"}


def describe_model(model_id: str) -> str:
    """Set the LoggedModel's description from what the store holds (module docstring); returns it."""
    import mlflow

    from slmsql.stats.wording import pct
    from slmsql.tracking.descriptions import run_link
    from slmsql.tracking.runs import NOTE

    client = mlflow.MlflowClient()
    model = client.get_logged_model(model_id)
    tags, files = model.tags, model.tags.get(FILES_TAG, "")
    if model.source_run_id:
        run = client.get_run(model.source_run_id)
        p, stage, adapter = run.data.params, tags.get("slmsql.stage", ""), tags.get(KIND_TAG) == "adapter"
        text = (f"{STAGE_NAMES.get(stage, stage)} policy ({'a LoRA adapter' if adapter else 'a full model'}), "
                f"trained by run {run_link(run)} on `{p.get('data', '?')}`, starting from `{p.get('model', '?')}`"
                + (f" with the adapter `{p['base_adapter']}`" if p.get("base_adapter") else "") + ".\n\nFiles: "
                + (f"this model's artifacts, `{files.rsplit('/', 1)[-1]}/` (copied when the run ended), and the "
                   f"run's artifact `{files}`, by which every stage loads it." if adapter else
                   f"the run's artifact `{files}`, by which every stage loads it (a full model: not copied here)."))
    else:
        text = (f"A model slmsql did not train, used as it is: `{files}`.\n\nFiles: none here; every stage loads it "
                f"from `{files}` (a Hub id or a path in the project).")
    if "slmsql.fingerprint" in tags:
        text += " It also holds the servable `text2sql` MLflow model (pyfunc) that `publish` logged and registered."
    latest = {}
    for m in sorted((m for m in model.metrics or [] if m.key in MODEL_METRICS), key=lambda m: m.timestamp):
        latest[m.dataset_name] = m  # each eval set's latest evaluation
    ex = [f"{name} {pct(m.value)}" + (f" ({run_link(client.get_run(m.run_id))})" if m.run_id else "")
          for name, m in sorted(latest.items())]
    text += "\n\nEX per eval set: " + (", ".join(ex) if ex else "not evaluated yet") + "."
    text += "\n\nTags: " + ", ".join(f"`{k}` = {v}" for k, v in sorted(tags.items()) if k.startswith("slmsql.")) + "."
    client.set_logged_model_tags(model_id, {NOTE: text})
    return text


def trained_by(model: str, adapter: str = "") -> str | None:
    """The id of the run that trained the policy at `adapter` (else `model`), when that is a fetched run artifact
    (runs:/<id>/..., or its local copy): the run whose LoggedModel an evaluation's metrics belong to. Given an
    adapter, the adapter alone says: one no run is known to have written (a local folder) makes it None, never
    the base's run (the base's model would take the adapter's EX as its own)."""
    path = tracking.param_value(adapter or model)
    return m[1] if path and (m := tracking.RUN_URI.fullmatch(path)) else None


def model_of(model: str, adapter: str = "") -> str | None:
    """The LoggedModel id of the evaluated policy (`trained_by`'s run's tag), or None (a Hub model, a folder no
    run is known to have written, a run from before LoggedModels)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    run_id = trained_by(model, adapter)
    if run_id is None:
        return None
    try:
        return mlflow.MlflowClient().get_run(run_id).data.tags.get(MODEL_TAG)
    except MlflowException:
        return None


def policy_model(experiment_id: str, model: str, adapter: str = "") -> str | None:
    """The LoggedModel of the policy a run samples or scores: the trained policy's (`model_of`); for a model no run
    here trained, used as it is (a Hub model zero-shot, a folder in the project), an external LoggedModel named
    after it (`external_model`); None for a predictions file, an adapter of unknown origin (a policy only with
    its base, which no name here records: pass it by its run URI to credit its run), or a folder outside the
    project (an absolute path of this machine names nothing elsewhere)."""
    if not model:
        return None
    if trained_by(model, adapter) is not None:
        return model_of(model, adapter)
    if adapter:
        log.info("the adapter %s is no run's artifact: its EX stays on the run, credited to no LoggedModel "
                 "(pass it as runs:/<run id>/adapter to credit the run that trained it)", tracking.portable(adapter))
        return None
    ref = tracking.portable(model)
    if os.path.isabs(ref):
        return None
    return external_model(experiment_id, ref, digest(model) if os.path.isdir(model) else "")


def external_model(experiment_id: str, ref: str, content: str = "") -> str:
    """The LoggedModel (READY, no files of ours) of a model slmsql did not train, named by `ref` (a Hub id or a
    project path) in its tag `slmsql.files`, by which every later run finds the same one. A folder's model is
    also found by its `content` (`digest`, tag `slmsql.digest`): a folder retrained in place is a new model."""
    import mlflow
    from mlflow.entities import LoggedModelStatus

    client = mlflow.MlflowClient()
    if "'" not in ref:  # a quote cannot be written in a search filter; such a model gets one model per run
        for found in client.search_logged_models([experiment_id], filter_string=f"tags.`{FILES_TAG}` = '{ref}'"):
            if found.tags.get(DIGEST_TAG, "") == content:
                return found.model_id
    tags = {FILES_TAG: ref, "slmsql.stage": "external", **({DIGEST_TAG: content} if content else {})}
    model = client.create_logged_model(experiment_id, name=model_name(ref), model_type=TYPE, tags=tags)
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    return model.model_id


def digest(folder) -> str:
    """What a model folder holds: a sha256 over each top-level file's name and bytes (configs, tokenizer,
    weights or adapter; checkpoints below are not the model). Reads the files once, as loading the model does
    (about a second per GB on one core): a sample of the weights would miss a retraining that moved only
    a LoRA merge's few matrices, and that model would take the old one's EX."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(folder).iterdir() if p.is_file()):
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:16]


def log_model_input(run_id: str, model_id: str | None) -> None:
    """Record `model_id` as what the run used (its policy): the model's page lists the run, the run's the model."""
    import mlflow
    from mlflow.entities import LoggedModelInput

    if model_id:
        mlflow.MlflowClient().log_inputs(run_id, models=[LoggedModelInput(model_id)])
        describe_model(model_id)
