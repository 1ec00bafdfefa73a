"""The `text2sql` MLflow model: a published adapter with its base, its prompt and its generation settings.

A Text-to-SQL adapter is only usable with the prompt it was trained on, which no generic flavor knows. This
pyfunc holds everything needed to answer as the evaluation did:
- the adapter (artifact `adapter`) and the base: a Hub id (`base_model` in the model config) or, for a local
  base (a full fine-tune), its weights (artifact `base`);
- the prompt builder's settings (`prompt_style`, `example_values`) and the generation settings
  (`max_new_tokens`, `batch_size`; greedy), read from the evaluation runs the card reports;
- SQL extraction (slmsql.sql.extract).
Rows in: `question`, plus `schema` (CREATE TABLE text) or `db_path` (an SQLite file on the serving machine: its
schema text is built as training and evaluation prompts were), and optional `evidence`. Rows out: `sql` (null
when the completion holds none) and the raw `completion`.

Prompts, generation and extraction are the library's own (PromptBuilder, generation.greedy_answers,
models.load_model), so for the same questions in the same order the served SQL is evaluate's SQL.

Code: the model carries no copy of slmsql (no `code_paths`). Its python_model pickle is a reference to
`slmsql.publishing.text2sql.Text2SQL`, so it loads where slmsql is installed: `mlflow models serve --env-manager
local` from the environment slmsql is installed in. (Until the library moved into domain packages the reference
was `slmsql.text2sql.Text2SQL`: a model logged then loads with that slmsql; `slmsql publish` logs it again.) A code_paths copy would not make the model self-contained (it
still needs torch, transformers and peft at the pinned versions), and in a process that already imported
slmsql MLflow would swap the library's modules for the copy's mid-process.
"""

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path

import mlflow.pyfunc
import pandas as pd

from slmsql.errors import SlmsqlError
from slmsql.runtime.outputs import link_or_copy

log = logging.getLogger(__name__)
NAME = "text2sql"  # the logged model's name
DRY_RUN_NAME = "text2sql-dry-run"  # publish --dry-run's model: a LoggedModel of its own, never the policy's
SETTINGS = ("prompt_style", "example_values", "max_new_tokens", "batch_size")  # what evaluate's SQL depends on
INPUTS = (("question", True), ("schema", False), ("db_path", False), ("evidence", False))
INPUT_EXAMPLE = [{"question": "How many items cost more than 2?",
                  "schema": "CREATE TABLE item (id INTEGER PRIMARY KEY, name TEXT, price REAL);"}]
REQUIREMENTS = ("mlflow", "torch", "transformers", "peft", "pandas", "cloudpickle")


def settings_from_runs(grpo, evals) -> dict:
    """The prompt and generation settings of the evaluation runs (which must agree with each other and with
    the prompt GRPO trained on): the settings the served model must use to give their SQL."""
    seen = {}
    for run in evals:
        p = run.data.params
        missing = [k for k in SETTINGS if k not in p]
        if missing:
            raise SlmsqlError(f"evaluation run {run.info.run_id} records no {missing}: cannot tell how to serve "
                              "the model as it was evaluated")
        if p.get("answer_prefix"):
            raise SlmsqlError(f"evaluation run {run.info.run_id} gave the model the start of its answer "
                              f"(answer_prefix={p['answer_prefix']!r}): the served model writes its whole answer, "
                              "as GRPO trained it, so that run does not say how it answers")
        seen[run.info.run_id] = {k: p[k] if k == "prompt_style" else int(float(p[k])) for k in SETTINGS}
        if p.get("backend", "transformers") != "transformers":
            log.warning("evaluation run %s generated with %s; the served model generates with transformers",
                        run.info.run_id, p["backend"])
    if len({json.dumps(s, sort_keys=True) for s in seen.values()}) != 1:
        raise SlmsqlError(f"the evaluation runs used different prompt or generation settings ({seen}): one "
                          "served model can reproduce only one of them")
    settings = next(iter(seen.values()))
    trained = {k: grpo.data.params.get(k) for k in ("prompt_style", "example_values")}
    if trained != {k: str(settings[k]) for k in trained}:
        raise SlmsqlError(f"GRPO run {grpo.info.run_id} trained on prompts {trained}, the evaluation runs used "
                          f"{ {k: settings[k] for k in trained} }: the model would be served with a prompt it "
                          "was not trained on")
    return settings


def _config(model_config: dict):
    """The evaluate config the served model generates with: greedy, transformers, its recorded settings."""
    from slmsql.configs import EvaluateConfig

    return EvaluateConfig(**{k: model_config[k] for k in SETTINGS}, backend="transformers")


def _given(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value)) and str(value).strip() != ""


def _rows(model_input) -> list[dict]:
    if isinstance(model_input, dict):
        model_input = [model_input]
    frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(list(model_input))
    rows = []
    for i, row in enumerate(frame.to_dict("records")):
        if not _given(row.get("question")) or not isinstance(row["question"], str):
            raise SlmsqlError(f"row {i + 1}: field 'question': a non-empty string is required")
        sources = [k for k in ("schema", "db_path") if _given(row.get(k))]
        if len(sources) != 1:
            raise SlmsqlError(f"row {i + 1}: give exactly one of the fields schema and db_path "
                              f"(got {' and '.join(sources) or 'neither'})")
        rows.append({k: row.get(k) if _given(row.get(k)) else None for k, _ in INPUTS})
    return rows


class Text2SQL(mlflow.pyfunc.PythonModel):
    """Question (+ schema text or database path) -> greedy completion -> SQL. Holds no state until loaded."""

    def load_context(self, context):
        from slmsql.policy.models import load_model

        cfg = context.model_config
        self._cfg = _config(cfg)
        base = context.artifacts.get("base") or cfg["base_model"]
        if base is None and cfg.get("base_uri"):  # a dry run's local base: a run's artifact, fetched (publish.ship)
            with tempfile.TemporaryDirectory() as tmp:
                self._model = load_model(_fetch_base(cfg["base_uri"], cfg["base_repo"], Path(tmp)),
                                         context.artifacts["adapter"])
            return
        self._model = load_model(base, context.artifacts["adapter"])

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        # (a DataFrame type hint: MLflow infers nothing from it; the signature below is the model's)
        from mlflow.exceptions import MlflowException

        from slmsql.generation.sampling import greedy_answers
        from slmsql.inputs.prompts import builder_for, render_prompt

        try:
            rows = _rows(model_input)
            builder = builder_for(self._cfg, ".")  # a fresh one per call: a database may change between calls
            tokenizer = self._model[1]
            prompts = [render_prompt(tokenizer, builder.chat(
                r["question"], r["schema"] if r["schema"] is not None else builder.schema_of_file(r["db_path"]),
                r["evidence"])) for r in rows]
        except SlmsqlError as e:  # the scoring server answers 400 (not 500) with the message
            raise MlflowException.invalid_parameter_value(f"text2sql input: {e}") from None
        answers = greedy_answers(self._cfg, prompts, self._model)
        return pd.DataFrame({"sql": [a["sql"] for a in answers], "completion": [a["completion"] for a in answers]},
                            columns=["sql", "completion"])


def signature():
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    return ModelSignature(inputs=Schema([ColSpec("string", name, required=req) for name, req in INPUTS]),
                          outputs=Schema([ColSpec("string", "sql", required=False), ColSpec("string", "completion")]))


def requirements() -> list[str]:
    """The pins of the packages the model imports, from this environment, and slmsql itself (install it from
    its source: it is not on PyPI)."""
    from importlib.metadata import version

    from slmsql import __version__

    return [f"slmsql=={__version__}"] + [f"{name}=={version(name)}" for name in REQUIREMENTS]


def _fetch_base(uri: str, repo: str, dst: Path) -> Path:
    """A base named by its run artifact URI, downloaded into `dst` under the name of the repo the adapter names as
    its base (`stage_base`)."""
    from slmsql.tracking.runs import RUN_URI, download

    m = RUN_URI.fullmatch(uri)
    got = download(m[1], m[2], dst / "download")
    out = dst / repo.split("/")[1]
    got.rename(out)
    return out


def stage_base(base: Path, name: str, dst: Path) -> Path:
    """The local base for the model's artifacts, in a folder named after the Hub repo it was pushed to: the
    adapter records that repo as its base, and `check_adapter_base` matches a local copy by that name."""
    out = dst / name
    shutil.copytree(base, out, copy_function=link_or_copy)
    return out


def fingerprint(model_config: dict, commits: dict) -> str:
    """What makes two logged text2sql models the same: their settings and the Hub commits of their files."""
    return hashlib.sha256(json.dumps([model_config, commits], sort_keys=True).encode()).hexdigest()[:16]


def describe_text2sql(model_id: str, model_config: dict, commits: dict, eval_runs=(), filter_run: str = "",
                      registered: dict | None = None) -> str | None:
    """The description (its page in the MLflow UI) of a text2sql LoggedModel that is not a policy's own (a dry
    run's, `DRY_RUN_NAME`, or a push's when the policy's holds one already; the policy's is `describe_model`'s):
    what it serves, the adapter and the base it wraps, the runs behind it, whether it was pushed and where it is
    registered. Returns it (None, and nothing set, for a policy's model)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from slmsql.tracking.descriptions import run_link
    from slmsql.tracking.lineage import KIND_TAG
    from slmsql.tracking.runs import NOTE

    client = mlflow.MlflowClient()
    model = client.get_logged_model(model_id)
    if KIND_TAG in model.tags:
        return None

    def link(run_id: str) -> str:
        try:
            return run_link(client.get_run(run_id))
        except MlflowException:
            return f"`{run_id}`"

    dry = model.tags.get("slmsql.dry_run") == "true"
    c = model_config
    grpo = link(c["grpo_run"])
    text = (f"The servable `text2sql` MLflow model (pyfunc) that `slmsql publish{' --dry-run' if dry else ''}` "
            "logged: given a question and its database (CREATE TABLE text as `schema`, or an SQLite file's path as "
            "`db_path`), it answers with the SQL in the completion the policy generates greedily, with the prompt "
            "and generation settings of the evaluations below ("
            + ", ".join(f"`{k}` = {c[k]}" for k in SETTINGS if k in c) + ").")
    if c.get("base_uri"):
        base = (f"the run artifact `{c['base_uri']}`, fetched when the model loads (not copied here)"
                + (f"; a push would send it to `{c['base_repo']}`" if c.get("base_repo") else ""))
    elif c.get("base_model"):
        base = f"`{c['base_model']}` from the Hugging Face Hub, downloaded when the model loads"
    else:
        base = (f"this model's artifact `base/`, a local full model"
                + (f" pushed as `{c['base_repo']}`" if c.get("base_repo") and commits.get("base") else ""))
    text += (f"\n\nIt wraps the LoRA adapter that GRPO run {grpo} trained (this model's artifact `adapter/`: the "
             f"folder publish wrote, model card included) on the base {base}.")
    runs = [f"trained by GRPO run {grpo}"]
    if eval_runs:
        runs.append("evaluated by " + ", ".join(link(r) for r in eval_runs))
    if filter_run:
        runs.append(f"its RL band from filter run {link(filter_run)}")
    active = mlflow.active_run()
    if active is not None:
        runs.append(f"logged by publish run {link(active.info.run_id)}")
    text += "\n\nRuns behind it: " + "; ".join(runs) + "."
    if commits.get("adapter"):
        text += (f"\n\nPushed to `{c.get('hub_repo')}` (adapter commit {commits['adapter'][:10]}"
                 + (f", base commit {commits['base'][:10]}" if commits.get("base") else "") + ").")
    else:
        text += (f"\n\nNot pushed: a dry run sends nothing to the Hub (a push would go to `{c.get('hub_repo')}`) "
                 "and takes nothing a push made: the GRPO policy's own LoggedModel stays as it was.")
    if registered:
        text += (f" Registered as `{registered['registered_model']}` version {registered['model_version']}"
                 + (f" under the alias `{registered['alias']}`" if registered.get("alias") else "") + ".")
    client.set_logged_model_tags(model_id, {NOTE: text})
    return text


def log_text2sql(run_id: str, adapter: Path, model_config: dict, commits: dict, base: Path | None = None,
                 into: str | None = None, dry_run: bool = False):
    """Log the text2sql model to run `run_id`, in that run's experiment (reused when the run already holds one
    with the same fingerprint); returns (model URI, whether it was reused). `into`: the LoggedModel of the
    policy the run trained (tracking/lineage.py), which takes the servable model's files unless it holds a text2sql
    model already (then a LoggedModel of its own): run -> its policy's model -> the registered version, one line.
    `dry_run` (publish --dry-run, `into` None): a LoggedModel of its own named DRY_RUN_NAME, with no input example:
    given one, MLflow loads the model to answer it (the signature stays), which loads the base, minutes of Hub
    retries offline (pyfunc's save_model takes no switch for that check)."""
    import mlflow
    from mlflow.entities import LoggedModelStatus
    from mlflow.models import Model

    from slmsql import __version__

    fp = fingerprint(model_config, commits)
    client = mlflow.MlflowClient()
    experiment = client.get_run(run_id).info.experiment_id
    for found in client.search_logged_models([experiment], filter_string=f"tags.`slmsql.fingerprint` = '{fp}'"):
        if found.source_run_id == run_id and found.status == LoggedModelStatus.READY:
            log.info("text2sql model %s already logged to run %s", found.model_id, run_id)
            return f"models:/{found.model_id}", True
    policy = client.get_logged_model(into) if into else None
    if policy is not None and policy.source_run_id == run_id and "slmsql.fingerprint" not in policy.tags:
        model = policy
        client.set_logged_model_tags(model.model_id, {"slmsql.fingerprint": fp})
    else:  # created here, not by Model.log, which would file it under the active run's (publish's) experiment
        tags = {"slmsql.fingerprint": fp, **({"slmsql.dry_run": "true"} if dry_run else {})}
        model = client.create_logged_model(experiment, DRY_RUN_NAME if dry_run else NAME, source_run_id=run_id,
                                           tags=tags)
    # named relative to the folder they are in, entered while MLflow copies them: the model's MLmodel records each
    # artifact's source as given (`uri`), which would otherwise be a temporary folder of this machine
    here = Path(adapter).parent
    artifacts = {"adapter": Path(adapter).name} | ({"base": os.path.relpath(base, here)} if base is not None else {})
    try:
        # mlflow.pyfunc.log_model, with the run to log to named (the GRPO run, not the active one). MLflow then
        # loads the saved model and answers the input example, as its scoring server would (a warning if not):
        # for a push only (`dry_run`).
        # Into the policy's model: no run named, as it is an output of `run_id` already (MLflow would record
        # that twice, which its store refuses); the active run (publish) then records it as its output too.
        with contextlib.chdir(here):
            info = Model.log(artifact_path=None, flavor=mlflow.pyfunc, run_id=None if model is policy else run_id,
                             model_id=model.model_id,
                             python_model=Text2SQL(), artifacts=artifacts, model_config=model_config,
                             signature=signature(), input_example=None if dry_run else INPUT_EXAMPLE,
                             pip_requirements=requirements(),
                             metadata={"task": "text-to-sql", "slmsql_version": __version__})
    except BaseException:
        if model is policy:  # the policy itself is fine (its files are its run's): as it was, for a retry
            client.delete_logged_model_tag(model.model_id, "slmsql.fingerprint")
            client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        else:
            client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
        raise
    finally:  # Model.log makes the model "active": the run's later metrics (publish's) would be filed under it
        mlflow.clear_active_model()
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    if model is policy:  # its page says it holds the servable model now
        from slmsql.tracking.lineage import describe_model

        describe_model(model.model_id)
    return info.model_uri, False
