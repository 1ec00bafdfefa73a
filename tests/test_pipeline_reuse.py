"""Which pipeline steps rerun and which are reused, against a real SQLite MLflow store.

The real pipeline takes minutes, so each step's `mlflow.run` is replaced by `FakeRun`, which writes to the store
what the stage writes into the run `workflow.Steps` created for it (parent tag, every non-empty MLproject parameter logged,
defaults included), minus the work: what the stage adds (`slmsql.stage` tag, its resolved config as params where not logged yet, the
artifacts the next steps download, the metrics the headline prints) and a FINISHED status. `pipeline.main` and
`Steps` run for real: the parameters, the lookup of reusable runs, the artifact hand-over by run id.
"""

from __future__ import annotations

import functools
import json
import shlex
import shutil
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pytest
from mlflow.exceptions import ExecutionException

from slmsql import configs
from slmsql.errors import SlmsqlError
from slmsql.workflow import steps as workflow
from slmsql.stages import pipeline

STEPS = ["toy", "tiny-model", "sft", "filter", "grpo", "eval-sft-dev", "eval-grpo-dev", "eval-sft-dev_cross",
         "eval-grpo-dev_cross", "publish"]
DOWNSTREAM = {  # step -> the steps whose parameters carry its outputs (its artifacts or its run id), transitively
    "toy": STEPS[1:], "tiny-model": STEPS[2:], "sft": STEPS[3:], "filter": ["grpo", "eval-grpo-dev",
    "eval-grpo-dev_cross", "publish"], "grpo": ["eval-grpo-dev", "eval-grpo-dev_cross", "publish"]}
ARTIFACTS = {"toy": "toy/dev.jsonl", "tiny-model": "model/config.json", "sft": "policy/config.json",
             "filter": "band.jsonl", "grpo": "adapter/adapter_config.json"}
METRICS = {"band": 3, "all_fail": 1, "all_pass": 1, "out_of_band": 0, "errors": 0, "ex": 0.5,
           "summary/frac_reward_zero_std": 0.5, "summary/reward_std": 0.1,
           "summary/exec/frac_groups_correctness_varies": 0.5, "vs_baseline/p": 1.0}


class FakeRun:
    """Stands in for `mlflow.run`; `names` lists the steps it ran."""

    def __init__(self, tmp_path):
        self.tmp, self.names = tmp_path, []
        self.crash, self.calls = None, {}  # crash: a stage that dies half done; calls: step -> (run id, resume)

    def __call__(self, uri, entry_point, env_manager, run_id, parameters, synchronous):
        from mlflow.projects import _project_spec
        from mlflow.entities import Metric, Param, RunTag

        from slmsql.configs import STAGES, to_params

        assert env_manager == "local" and synchronous
        client = mlflow.MlflowClient()  # workflow.Steps made the run (parent tag, MLproject params) before this
        self.names.append(client.get_run(run_id).info.run_name)
        self.calls[self.names[-1]] = (run_id, parameters.get("resume"))
        # the stage: `slmsql <stage>` run by the shell with the command `mlflow run` builds (cli.py resolves it)
        stage = entry_point.replace("_", "-")
        partial = Path(parameters["output_dir"] + ".partial")
        if stage == self.crash:  # as a resumable stage leaves a crash: its work and resume state, the run unfinished
            partial.mkdir(parents=True, exist_ok=True)
            (partial / "resume_state.json").write_text(json.dumps({"identity": {}, "run_id": run_id}))
            client.set_terminated(run_id, "FAILED")
            raise ExecutionException(f"Run (ID '{run_id}') failed")
        shutil.rmtree(partial, ignore_errors=True)  # a stage that succeeds promotes its .partial/
        project = _project_spec.load_project(workflow.ROOT)
        command = project.get_entry_point(entry_point).compute_command(parameters, None)
        argv = shlex.split(command)[2:]
        values = {argv[i].removeprefix("--").replace("-", "_"): argv[i + 1] for i in range(0, len(argv), 2)}
        values.pop("recipe")
        cfg = configs.load(STAGES[stage], None, values, defaults_yield=True)
        logged = client.get_run(run_id).data.params
        client.log_batch(  # one write for what the stage logs (the store's cost is per transaction)
            run_id, params=[Param(k, v) for k, v in to_params(cfg).items() if k not in logged],
            metrics=[Metric(k, v, 0, 0) for k, v in METRICS.items()],
            tags=[RunTag("slmsql.stage", stage), RunTag("slmsql.verdict", "no significant difference")])
        if stage in ARTIFACTS:
            folder = self.tmp / "made" / run_id
            (folder / ARTIFACTS[stage]).parent.mkdir(parents=True, exist_ok=True)
            (folder / ARTIFACTS[stage]).write_text(run_id)
            client.log_artifacts(run_id, str(folder))
        client.set_terminated(run_id, "FINISHED")
        return SimpleNamespace(run_id=run_id)


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory):
    """A migrated, empty SQLite store, copied by each test (creating one costs seconds)."""
    path = tmp_path_factory.mktemp("store") / "mlflow.db"
    mlflow.MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def pipe(tmp_path, monkeypatch, empty_store):
    import os

    shutil.copy(empty_store, os.environ["MLFLOW_TRACKING_URI"].removeprefix("sqlite:///"))
    monkeypatch.chdir(tmp_path)  # artifacts land under ./mlruns, inside this test's folder
    fake = FakeRun(tmp_path)
    monkeypatch.setattr(mlflow, "run", fake)
    from mlflow.projects import _project_spec  # parsing MLproject costs ~0.5 s: once per test, not per step

    monkeypatch.setattr(_project_spec, "load_project", functools.lru_cache(_project_spec.load_project))

    def run(overrides="", reuse=True):
        """One pipeline run; returns the steps it ran (in order) and the finished runs by step name."""
        fake.names.clear()
        # a space in the path: `mlflow run` logs such parameters shell-quoted
        cfg = configs.load(configs.PipelineConfig, None, {"output_dir": str(tmp_path / "pipeline out"),
                                                          "overrides": overrides, "reuse": reuse})
        pipeline.main(cfg)
        client = mlflow.MlflowClient()
        parent = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id],
                                    "tags.`slmsql.stage` = 'pipeline'", order_by=["attributes.start_time DESC"])[0]
        return list(fake.names), parent

    run.fake = fake
    return run


def latest(name: str):
    client = mlflow.MlflowClient()
    return client.search_runs([client.get_experiment_by_name("slmsql").experiment_id],
                              f"attributes.run_name = '{name}'", order_by=["attributes.start_time DESC"])[0]


def below(step: str) -> list[str]:
    return [s for s in STEPS if s == step or s in DOWNSTREAM[step]]


@pytest.mark.slow
def test_parameter_changes_rerun_the_step_and_downstream_only(pipe):
    """One store's history; each pipeline run asserts exactly which steps ran (the others were reused)."""
    assert pipe("grpo.max_steps=3")[0] == STEPS
    assert pipe("grpo.max_steps=3")[0] == []  # nothing changed: everything reused
    # dropping the override means max_steps 50 (the default): that grpo run was never made
    assert pipe()[0] == below("grpo")
    assert latest("grpo").data.params["max_steps"] == "50"
    old_filter = latest("filter").info.run_id
    assert pipe("filter.k=4")[0] == below("filter")  # toy, tiny-model, sft, the SFT evaluations: reused
    # the rerun steps were handed the new upstream outputs, through their run ids
    new_filter, grpo = latest("filter").info.run_id, latest("grpo")
    assert new_filter != old_filter and grpo.data.params["data"] == f"runs:/{new_filter}/band.jsonl"
    assert latest("eval-grpo-dev").data.params["adapter"] == f"runs:/{grpo.info.run_id}/adapter"
    assert latest("publish").data.params["grpo_run"] == grpo.info.run_id
    # a trainer arg given through --overrides is a parameter like any other
    assert pipe("filter.k=4 grpo.trainer_args=warmup_steps=0.1")[0] == below("grpo")
    assert pipe("filter.k=4 grpo.trainer_args=warmup_steps=0.1 evaluate.max_new_tokens=64")[0] == \
        ["eval-sft-dev", "eval-grpo-dev", "eval-sft-dev_cross", "eval-grpo-dev_cross", "publish"]
    assert pipe("filter.k=4 grpo.trainer_args=warmup_steps=0.1 evaluate.max_new_tokens=64")[0] == []


@pytest.mark.slow
def test_code_version_change_or_reuse_false_reruns_everything(pipe, monkeypatch):
    assert pipe()[0] == STEPS
    monkeypatch.setattr(workflow, "code_version", lambda: "another-version")
    assert pipe()[0] == STEPS
    assert pipe(reuse=False)[0] == STEPS


def test_code_version_hashes_the_package_and_its_data(tmp_path, monkeypatch):
    root = tmp_path / "root"
    shutil.copytree(workflow.ROOT / "src" / "slmsql", root / "src" / "slmsql", symlinks=True,  # as a checkout:
                    ignore=shutil.ignore_patterns("__pycache__"))  # its data_checks and model_card link to the root's
    for folder in ("data_checks", "model_card"):
        shutil.copytree(workflow.ROOT / folder, root / folder)
    monkeypatch.setattr(workflow, "ROOT", root)
    monkeypatch.setattr(workflow, "PACKAGE", root / "src" / "slmsql")
    first = workflow.code_version()
    assert workflow.code_version() == first
    (root / "README.md").write_text("not code")  # outside what shapes a result: the same version
    assert workflow.code_version() == first
    for changed in ("src/slmsql/rewards/registry.py", "data_checks/rl.json", "model_card/README.md.j2"):
        path = root / changed
        path.write_text(path.read_text() + "\n")
        assert workflow.code_version() != first, changed
        first = workflow.code_version()
    assert "trl==" in workflow.dependency_versions()
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "99.0" if name == "trl" else real(name))
    assert workflow.code_version() != first  # an upgraded TRL trains differently


def test_step_paths_are_project_relative_inside_the_project(tmp_path, monkeypatch):
    """Steps run in the project folder: an output folder inside it is a relative param (`outputs/...`, the same
    in every clone), one outside it stays absolute, from whatever folder the workflow was started."""
    monkeypatch.chdir(tmp_path)
    inside = workflow.ROOT / "outputs" / "x" / ".." / "sft"
    assert workflow.project_path(inside) == "outputs/sft"
    assert workflow.project_path("rel/out") == str(tmp_path / "rel" / "out")
    steps = workflow.Steps.__new__(workflow.Steps)  # params() alone: no store needed
    steps.out, steps.experiment, steps.seed, steps.overrides, steps.recipes = workflow.ROOT / "outputs", "e", 0, {}, {}
    assert steps.params("sft", "sft", {})["output_dir"] == "outputs/sft"
    assert steps.params("sft", "sft", {"output_dir": tmp_path / "o"})["output_dir"] == str(tmp_path / "o")


@pytest.mark.slow
def test_a_step_a_crash_left_half_done_continues_in_its_own_run(pipe, tmp_path):
    """GRPO dies half done (its .partial/ and resume state left, its run FAILED, as the stage leaves a crash). The
    next pipeline run continues that run, with --resume, and hands it on to the steps after it; not a new, empty
    run beside it. With other GRPO parameters the step starts anew; a resume state naming a run this store lacks
    is refused, naming the folder."""
    partial = tmp_path / "pipeline out" / "grpo.partial"
    pipe.fake.crash = "grpo"
    with pytest.raises(ExecutionException):
        pipe("grpo.max_steps=3")
    crashed = latest("grpo").info
    assert crashed.status == "FAILED" and (partial / "resume_state.json").is_file()
    pipe.fake.crash = None
    ran, _ = pipe("grpo.max_steps=3")
    assert ran == STEPS[STEPS.index("grpo"):]  # the finished steps before it reused
    assert pipe.fake.calls["grpo"] == (crashed.run_id, "true")
    assert latest("grpo").info.run_id == crashed.run_id and latest("grpo").info.status == "FINISHED"
    assert mlflow.MlflowClient().get_run(pipe.fake.calls["eval-grpo-dev"][0]).data.params["adapter"] == \
        f"runs:/{crashed.run_id}/adapter"
    assert not partial.exists()

    pipe.fake.crash = "grpo"
    with pytest.raises(ExecutionException):
        pipe("grpo.max_steps=4")
    crashed = latest("grpo").info
    pipe.fake.crash = None
    pipe("grpo.max_steps=5")  # other parameters: not the crashed run's work
    assert pipe.fake.calls["grpo"][0] != crashed.run_id and pipe.fake.calls["grpo"][1] is None

    partial.mkdir()
    (partial / "resume_state.json").write_text(json.dumps({"identity": {}, "run_id": "0" * 32}))
    with pytest.raises(SlmsqlError, match=r"grpo\.partial holds the unfinished work of run 0{32}, which is not in "
                                          r"this tracking store"):
        pipe("grpo.max_steps=6")


def test_an_unfinished_step_inside_the_project_is_found_from_any_folder(tmp_path, monkeypatch):
    """A step's output folder inside the project is a project-relative parameter (`outputs/...`); the workflow
    finds the unfinished run there whatever folder it was started from."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(workflow.ROOT / "MLproject", root)  # the step's run is made from its entry point's parameters
    monkeypatch.setattr(workflow, "ROOT", root)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    client = mlflow.MlflowClient()
    steps = workflow.Steps(client.create_experiment("e"), output_dir=root / "outputs", experiment="e")
    params = steps.params("grpo", "grpo", {"max_steps": 6})
    assert params["output_dir"] == "outputs/grpo"
    run = steps._create("grpo", "grpo", {**params, "overwrite": "true"}, {})
    (root / "outputs" / "grpo.partial").mkdir(parents=True)
    (root / "outputs" / "grpo.partial" / "resume_state.json").write_text(
        json.dumps({"identity": {}, "run_id": run.info.run_id}))
    assert steps.unfinished("grpo", params).info.run_id == run.info.run_id
    assert steps.unfinished("grpo", {**params, "max_steps": 7}) is None  # other parameters: not its work


def test_an_unfinished_step_is_continued_only_by_its_code_and_not_with_reuse_off(tmp_path, monkeypatch, caplog):
    """Half a step's work computed by other code would be finished by this code: started anew, and said. With
    reuse off, nothing made before is taken: started anew too."""
    caplog.set_level("INFO", logger="slmsql.workflow.steps")
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(workflow.ROOT / "MLproject", root)
    monkeypatch.setattr(workflow, "ROOT", root)
    client = mlflow.MlflowClient()
    experiment = client.create_experiment("e")
    steps = workflow.Steps(experiment, output_dir=root / "outputs", experiment="e")
    params = steps.params("grpo", "grpo", {"max_steps": 6})
    run = steps._create("grpo", "grpo", {**params, "overwrite": "true"}, {})  # tagged with this code's version
    (root / "outputs" / "grpo.partial").mkdir(parents=True)
    (root / "outputs" / "grpo.partial" / "resume_state.json").write_text(
        json.dumps({"identity": {}, "run_id": run.info.run_id}))
    assert steps.unfinished("grpo", params).info.run_id == run.info.run_id
    assert workflow.Steps(experiment, output_dir=root / "outputs", experiment="e",
                          reuse=False).unfinished("grpo", params) is None
    assert "not continued (reuse is off)" in caplog.text
    client.set_tag(run.info.run_id, "slmsql.code_version", "0ldc0de0ldc0")
    assert steps.unfinished("grpo", params) is None
    assert f"made by code 0ldc0de0ldc0, not this code ({steps.version}): not continued" in caplog.text
