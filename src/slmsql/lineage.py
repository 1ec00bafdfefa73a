"""MLflow 3's model-centric lineage: each trained policy is a LoggedModel, made by the run that trained it, and
each evaluation's EX is a metric of that model on its eval set (the experiment's Models tab).

A policy's LoggedModel holds no second copy of its weights: its tag `slmsql.files` names the run artifact that
holds them (`runs:/<training run>/policy` or `.../adapter`), which every stage loads by that URI. `publish` later
logs the servable text2sql model into the GRPO policy's LoggedModel and registers it (text2sql.log_text2sql), so
the registry's version, the model and the training run are one line. The training run carries the model's id as
the tag `slmsql.logged_model`, by which an evaluation finds the model of the policy it scored.
"""

from __future__ import annotations

import re

from . import tracking

MODEL_TAG = "slmsql.logged_model"  # on a training run: the id of the LoggedModel of the policy it trained
FILES_TAG = "slmsql.files"  # on a LoggedModel: the run artifact holding its files (runs:/<run id>/<path>)
TYPE = "text2sql-policy"
NOT_IN_NAMES = re.compile(r"[/:.%\"']")  # what MLflow refuses in a LoggedModel's name (a sweep cell: runs_tier=0.1)


def model_name(run_name: str) -> str:
    """The run's name as a LoggedModel may be named: each character MLflow refuses there becomes '_'."""
    return NOT_IN_NAMES.sub("_", run_name)


def start_policy_model(run_id: str, name: str, files: str) -> str:
    """The LoggedModel (PENDING) of the policy run `run_id` is training, an output of that run, with the run's
    params, its files named by `files` (an artifact path of the run). The run's end finalizes it
    (durable.Outbox.track_model). A resumed run keeps the model it started with. Needs the server: called where
    the run has just started."""
    import mlflow
    from mlflow.entities import LoggedModelOutput

    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    if (have := run.data.tags.get(MODEL_TAG)):
        return have
    model = client.create_logged_model(
        run.info.experiment_id, name=model_name(name), source_run_id=run_id, model_type=TYPE,
        tags={FILES_TAG: f"runs:/{run_id}/{files}", "slmsql.stage": run.data.tags.get("slmsql.stage", "")},
        params={k: v[:6000] for k, v in run.data.params.items()})
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])
    client.set_tag(run_id, MODEL_TAG, model.model_id)
    return model.model_id


def trained_by(model: str, adapter: str = "") -> str | None:
    """The id of the run that trained the policy at `adapter` (else `model`), when that is a fetched run artifact
    (runs:/<id>/..., or its local copy): the run whose LoggedModel an evaluation's metrics belong to."""
    for path in (adapter, model):
        if path and (m := tracking.RUN_URI.fullmatch(tracking.param_value(path))):
            return m[1]
    return None


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
