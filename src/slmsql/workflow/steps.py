"""Multistep workflows (MLflow's pattern), shared by `pipeline` and `sweep`: each step is its own
`mlflow.run` (local env manager) child of one parent run, and a finished step whose parameters and code
version match is reused instead of re-run; one a crash left half done with these parameters continues in its run.

Steps hand each other their outputs by run URI (artifacts downloaded from the tracking store, so a remote
server works the same).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import shlex
from pathlib import Path

from slmsql import configs
from slmsql.errors import SlmsqlError
from slmsql.runtime import outputs
from slmsql.workflow import mlproject

log = logging.getLogger(__name__)
PACKAGE = Path(__file__).resolve().parents[1]  # src/slmsql
ROOT = PACKAGE.parents[1]  # the MLproject folder


def code_version() -> str:
    """Hash of everything that shapes a step's result: the whole package, the data-check suites, the card
    template and the installed versions of the package's dependencies (a TRL or torch upgrade changes what
    training computes). A reused step must have been produced by this code."""
    h = hashlib.sha256()
    # the suites and the card's templates as the package carries them (in a checkout: links to the top-level
    # folders), named as they were when they were read from there, so a checkout's version is unchanged
    files = [*PACKAGE.rglob("*.py"), *(PACKAGE / "data_checks").glob("*.json"), *(PACKAGE / "model_card").glob("*")]
    for f in sorted(f for f in files if f.is_file() and "__pycache__" not in f.parts):
        name = f.relative_to(PACKAGE)
        name = name if name.parts[0] in ("data_checks", "model_card") else Path("src", "slmsql", name)
        h.update(str(name).encode() + b"\0" + f.read_bytes())
    h.update(dependency_versions().encode())
    return h.hexdigest()[:12]


def dependency_versions() -> str:
    """`name==version` of each installed dependency of slmsql (test extras aside), one a line."""
    import re
    from importlib import metadata

    try:
        requires = metadata.requires("slmsql") or []
    except metadata.PackageNotFoundError:  # run from a source tree without being installed
        return ""
    lines = []
    for name in sorted({re.match(r"[A-Za-z0-9._-]+", r)[0] for r in requires if "extra ==" not in r}):
        try:
            lines.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{name} absent")
    return "\n".join(lines)


def _unquoted(value: str) -> str:
    """A parameter `mlflow run` logged as it put it on the shell command line (shlex-quoted: '' for empty)."""
    try:
        parts = shlex.split(value)
    except ValueError:
        return value
    return parts[0] if len(parts) == 1 else value


def resolved(stage: str, values: dict):
    """The stage's config object from a step's parameters, as `slmsql <stage>` resolves them (unset fields: their
    defaults, which `mlflow run` passes too)."""
    cls = configs.STAGES[stage]
    names = {f.name for f in dataclasses.fields(cls)}
    return configs.load(cls, None, {k: v for k, v in values.items() if k in names}, require=False)


def stage_config(stage: str, values: dict) -> dict:
    """The stage config a step with these parameters computes with (`resolved`), as a dict, less `overwrite`,
    which shapes no result. Comparing whole configs, not the parameters given, is what makes dropping an override
    rerun the step."""
    return {k: v for k, v in dataclasses.asdict(resolved(stage, values)).items() if k != "overwrite"}


def _ran_with(stage: str, run, want: dict) -> bool:
    """Whether `run` computed with the stage config `want` (`stage_config`): a run whose params this code cannot
    read back did not."""
    try:
        return stage_config(stage, {k: _unquoted(v) for k, v in run.data.params.items()}) == want
    except SlmsqlError:
        return False


def use_this_cli() -> None:
    """`mlflow run` starts each step as `slmsql <stage>`: make this environment's CLI the one it finds. The steps
    are entry points of slmsql's MLproject, which a checkout has and an installed wheel does not: refused there,
    before any run or output, saying so."""
    import os
    import sys

    if not (ROOT / "MLproject").is_file():
        raise SlmsqlError(f"pipeline and sweep run each step as `mlflow run` of slmsql's MLproject, which is not "
                          f"beside this installed package ({PACKAGE}): run them from a checkout of slmsql (git "
                          "clone, then pip install -e .), or run the stages one by one (slmsql toy, sft, filter, "
                          "grpo, evaluate, publish), which need no checkout")

    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def project_path(path) -> str:
    """A local path as a step's parameter. Steps run in the project folder (`mlflow.run`), so a path inside it
    is written relative to it (`outputs/sft`: params that read the same on every machine and in every clone),
    a path outside it absolute."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def recipes_of(folder: str) -> dict[str, dict]:
    """stage -> the parameters its recipe `<folder>/<stage>.yaml` sets (as parameter text), every recipe read and
    checked now, before any step runs. A YAML file named for no stage is refused (a typo would be ignored)."""
    if not folder:
        return {}
    path = Path(folder)
    if not path.is_dir():
        raise SlmsqlError(f"--recipes {folder}: no such folder")
    out = {}
    for file in sorted(path.glob("*.yaml")):
        if file.stem not in configs.STAGES:
            raise SlmsqlError(f"{file}: named for no stage (expected one of {sorted(configs.STAGES)}.yaml)")
        values = configs.recipe_values(configs.STAGES[file.stem], file)
        out[file.stem] = {k: configs.param_text(v) for k, v in values.items()}
    return out


class Steps:
    """The steps of one workflow run: each writes to `output_dir`/<name> unless given its own output_dir, and
    gets `seed` unless given its own. A step's parameters, in increasing precedence: its stage's recipe in the
    `recipes` folder (`<stage>.yaml`, when there is one), the step's own parameters (the workflow's wiring),
    then `overrides` ({"<stage>.<field>": value}, for every step of that stage)."""

    def __init__(self, experiment_id: str, *, output_dir, experiment: str, seed: int = 0, reuse: bool = True,
                 overrides: dict | None = None, recipes: str = ""):
        import mlflow

        self.experiment_id, self.experiment, self.seed, self.reuse = experiment_id, experiment, seed, reuse
        self.overrides, self.version = dict(overrides or {}), code_version()
        self.recipes = recipes_of(recipes)
        self.client = mlflow.MlflowClient()
        self.out = Path(output_dir).resolve()
        self.reused: list[str] = []  # run ids reused by this workflow run

    def params(self, stage: str, name: str, given: dict) -> dict:
        extra = {k.split(".", 1)[1]: v for k, v in self.overrides.items() if k.split(".", 1)[0] == stage}
        params = {"output_dir": self.out / name, "experiment": self.experiment, "run_name": name,
                  "seed": self.seed, **self.recipes.get(stage, {}), **given, **extra}
        return {**params, "output_dir": project_path(params["output_dir"])}

    def config(self, stage: str, name: str, **given):
        """The config the step `name` of `stage` would run with, given these parameters (before it runs)."""
        return resolved(stage, self.params(stage, name, given))

    def find(self, stage: str, params: dict):
        """The latest finished run of `stage` by this code version whose resolved config equals the one these
        parameters give, or None. A step's config holds its upstream outputs (run URIs runs:/<run id>/<path>,
        run ids), so a rerun step reruns everything downstream of it."""
        runs = self.client.search_runs(
            [self.experiment_id], f"tags.`slmsql.stage` = '{stage}' and tags.`slmsql.code_version` = "
            f"'{self.version}' and attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"])
        want = stage_config(stage, params)
        return next((run for run in runs if _ran_with(stage, run, want)), None)

    def run(self, stage: str, name: str, tags: dict | None = None, **given):
        """Run (or reuse) one step; returns its finished MLflow run. `tags` are on the step's run from its start
        (a reused run keeps the tags it was made with)."""
        import mlflow

        params = self.params(stage, name, given)
        if self.reuse and (found := self.find(stage, params)):
            log.info("step %-14s reused run %s", name, found.info.run_id)
            self.reused.append(found.info.run_id)
            return found
        entry_point = mlproject.entry_point(stage)
        if run := self.unfinished(stage, params):  # a crash left this step's work half done: go on from it
            log.info("step %-14s continues its unfinished run %s ...", name, run.info.run_id)
            resumes = "resume" in {f.name for f in dataclasses.fields(configs.STAGES[stage])}  # else implicit
            resume = {"resume": "true"} if resumes else {}
        else:
            log.info("step %-14s running ...", name)
            run, resume = self._create(entry_point, name, {**params, "overwrite": "true"}, tags or {}), {}
        # the run exists, tagged, before the step starts: `mlflow.run` then runs the entry point in it, blocking
        # (waiting without blocking would start one more `mlflow run` process per step)
        mlflow.run(str(ROOT), entry_point=entry_point, env_manager="local", run_id=run.info.run_id,
                   parameters={**params, "overwrite": "true", **resume}, synchronous=True)
        return self.client.get_run(run.info.run_id)

    def unfinished(self, stage: str, params: dict):
        """The run a crash left unfinished in this step's output folder (`.partial/`, runtime/outputs.py) when
        it ran with these parameters and this code version, or None. The stage continues in it (its checkpoints,
        its finished rows) and the workflow hands on that run, not a new empty one. With other parameters, other
        code (half its work computed otherwise), or `reuse` false (nothing made before is taken): None, said, and
        a new run, which replaces that work or refuses it, as the stage decides."""
        from mlflow.exceptions import MlflowException

        # a path inside the project is relative to it (`project_path`), not to this process's folder
        if not (run_id := outputs.unfinished_run(ROOT / params["output_dir"])):
            return None
        if not self.reuse:
            log.info("%s.partial holds run %s's unfinished work: not continued (reuse is off), started anew",
                     params["output_dir"], run_id)
            return None
        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            raise SlmsqlError(f"{params['output_dir']}.partial holds the unfinished work of run {run_id}, which is "
                              "not in this tracking store: rerun with the store it ran in, or delete the folder "
                              "to start over") from None
        made_by = run.data.tags.get("slmsql.code_version")
        if made_by != self.version:
            log.warning("%s.partial holds run %s's unfinished work, made by code %s, not this code (%s): not "
                        "continued, started anew", params["output_dir"], run_id, made_by, self.version)
            return None
        return run if _ran_with(stage, run, stage_config(stage, params)) else None

    def _create(self, entry_point: str, name: str, params: dict, tags: dict):
        """The step's run as `mlflow.run` would create it (a child of the active run, the entry point's
        parameters with MLproject's defaults filled in, empty ones left out), plus the code version and `tags`."""
        import mlflow
        import yaml
        from mlflow.entities import Param
        from mlflow.utils import mlflow_tags

        from slmsql.tracking.runs import project_source

        declared = yaml.safe_load((ROOT / "MLproject").read_text())["entry_points"][entry_point]["parameters"]
        values = {**{k: spec["default"] for k, spec in declared.items() if "default" in spec}, **params}
        values = {k: v for k, v in values.items() if str(v) != ""}  # an empty option is not logged (its default)
        parent = mlflow.active_run()
        run = self.client.create_run(self.experiment_id, run_name=name, tags={
            mlflow_tags.MLFLOW_SOURCE_TYPE: "PROJECT", mlflow_tags.MLFLOW_SOURCE_NAME: project_source(ROOT),
            mlflow_tags.MLFLOW_PROJECT_ENTRY_POINT: entry_point, "slmsql.code_version": self.version,
            **({mlflow_tags.MLFLOW_PARENT_RUN_ID: parent.info.run_id} if parent else {}),
            **{k: str(v) for k, v in tags.items()}})
        self.client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in values.items()])
        return run

    def uri(self, run, path: str) -> str:
        """A step's output as the next step's input: its run URI, which the next step's params keep and its CLI
        fetches (`tracking.fetch_inputs`, into <output_dir>/../from-runs/<run id>/: the same folder as `artifact`)."""
        return f"runs:/{run.info.run_id}/{path}"

    def artifact(self, run, path: str) -> str:
        """A step's output, fetched once into a stable folder, for the workflow itself to read."""
        from slmsql.tracking.runs import fetch

        return fetch(self.uri(run, path), self.out)
