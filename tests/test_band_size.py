"""A band too small for one GRPO optimizer step (issue 55): refused by GRPO before any model loads, failed by the rl
data check, and where the pipeline meets one it stops there, evaluating nothing; a GRPO run that still made no
step fails, its run not FINISHED.

The rule (`configs.step_draw`): TRL 1.16's RepeatSampler cuts each pass over the RL set into draws of
generation_batch_size / num_generations distinct questions and drops a last, shorter one, so a set smaller than one
draw leaves the trainer nothing (observed: a 1-question band at the default shape, 0 steps, the run FINISHED).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pytest
from mlflow.exceptions import ExecutionException
from policy import write
from test_pipeline_reuse import FakeRun

from slmsql import configs
from slmsql.checks import datachecks
from slmsql.errors import SlmsqlError
from slmsql.runtime import distributed
from slmsql.stages import grpo, pipeline
from slmsql.workflow import steps as workflow

DEFAULT_WHY = "per_device_train_batch_size 16 x gradient_accumulation_steps 1 x 1 process / num_generations 8"


def band(path, n: int) -> Path:
    """A filter band of `n` questions on conftest's `shop` database."""
    return write(path, [{"id": f"q{i}", "db_id": "shop", "question": f"Items above {i}?",
                         "sql": f"SELECT name FROM item WHERE price > {i}", "pass_rate": 0.5, "k": 4, "n_correct": 2}
                        for i in range(n)])


def no_run_started():
    return [e.name for e in mlflow.MlflowClient().search_experiments()] in ([], ["Default"])


# ---- GRPO refuses it, through the command line, before any model loads -----------------------------------

@pytest.mark.slow
def test_a_band_too_small_for_one_step_is_refused_by_name_before_any_model_loads(shop, tmp_path):
    """A filter's output folder whose band holds 1 question, at the default batch shape (2 a step): `slmsql grpo`
    in a new process exits 2 naming the band's size, what a step draws and why, and the folder it came from. The
    model path does not exist, so a model load before the check would fail with another message; no output
    folder and no MLflow run are left."""
    filter_out = tmp_path / "filter"
    filter_out.mkdir()
    data = band(filter_out / "band.jsonl", 1)
    (filter_out / "summary.json").write_text(json.dumps({"n_source": 300, "buckets": {"band": 1}}))
    out = tmp_path / "grpo"
    proc = subprocess.run([sys.executable, "-m", "slmsql.cli", "grpo", "--data", str(data), "--db-root", str(shop),
                           "--model", str(tmp_path / "no-such-model"), "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"the RL data {data} (the band of the filter output folder {filter_out}, 300 source questions) holds " \
           f"1 question, fewer than one optimizer step draws: 2 distinct questions ({DEFAULT_WHY})" in error
    assert "no optimizer step" in error and "no-such-model" not in error
    assert not out.exists() and not out.with_name("grpo.partial").exists()
    assert no_run_started()


# ---- the rule, at its edge, against TRL's own sampler ----------------------------------------------------

SHAPES = [  # (stage options, processes, questions one step draws)
    ({}, 1, 2),
    ({"num_generations": 4}, 1, 4),
    ({"gradient_accumulation_steps": 3}, 1, 6),
    ({"num_generations": 4, "per_device_train_batch_size": 8}, 2, 4),
    ({"trainer_args": "steps_per_generation=2"}, 1, 4),
    ({"trainer_args": "generation_batch_size=48"}, 1, 6),
    ({"num_generations": 16, "per_device_train_batch_size": 16}, 1, 1),
]


@pytest.mark.parametrize("over, world, need", SHAPES)
@pytest.mark.slow
def test_a_band_that_exactly_meets_the_minimum_is_not_refused(shop, tmp_path, monkeypatch, over, world, need):
    """`check_args` lets a band of exactly one step's draw through and refuses one question fewer, naming the number;
    the number is what TRL's own sampler, built as GRPOTrainer builds it from GRPOConfig, needs to yield anything."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setattr(distributed, "world_size", lambda: world)
    cfg = configs.load(configs.GRPOStageConfig, None, {"data": "band.jsonl", "db_root": str(shop), **over})
    assert cfg.questions_per_step(world).questions == need
    examples = [SimpleNamespace(extra={"pass_rate": 0.5}) for _ in range(need)]
    grpo.check_args(cfg, examples)  # exactly enough: accepted
    with pytest.raises(SlmsqlError, match=rf"holds {need - 1} questions?, fewer than one optimizer step draws: "
                                          rf"{need} distinct questions"):
        grpo.check_args(cfg, examples[1:])
    if world != 1:
        return  # GRPOConfig takes its world size from the process it runs in
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to=[], bf16=False,
                      per_device_train_batch_size=cfg.per_device_train_batch_size, num_generations=cfg.num_generations,
                      gradient_accumulation_steps=cfg.gradient_accumulation_steps, **cfg.trainer_args)
    trainer = SimpleNamespace(args=args, num_generations=args.num_generations, num_iterations=args.num_iterations,
                              shuffle_dataset=True)
    for n, draws in ((need - 1, False), (need, True)):
        sampler = GRPOTrainer._get_train_sampler(trainer, Dataset.from_list([{"prompt": str(i)} for i in range(n)]))
        assert (len(list(sampler)) > 0) == draws, (n, need)


def test_trl_s_own_refusals_of_the_generation_batch_come_before_any_model_loads(shop):
    cfg = lambda extra: configs.load(configs.GRPOStageConfig, None, {"trainer_args": extra})  # noqa: E731
    with pytest.raises(SlmsqlError, match="set one of them, not both"):
        cfg("generation_batch_size=32 steps_per_generation=2").questions_per_step()
    with pytest.raises(SlmsqlError, match=r"generation_batch_size \(24\) must be a multiple of "
                                          r"per_device_train_batch_size \(16\) x 1 process"):
        cfg("generation_batch_size=24").questions_per_step()
    with pytest.raises(SlmsqlError, match="steps_per_generation.*positive integer"):
        cfg("steps_per_generation=0").questions_per_step()


# ---- the rl data check's minimum ---------------------------------------------------------------------------

@pytest.mark.slow
def test_the_rl_data_check_fails_a_band_smaller_than_its_minimum(shop, tmp_path):
    """Its default is what GRPO's default shape draws (the same rule), for filter and validate alike; a band below
    the minimum fails `band_fills_a_grpo_step`, the minimum in the report's parameters and description."""
    assert configs.FilterConfig().min_band == configs.ValidateConfig(data="x", db_root="y").min_band == \
        configs.GRPOStageConfig().questions_per_step().questions == 2
    one, two = band(tmp_path / "one.jsonl", 1), band(tmp_path / "two.jsonl", 2)
    report = datachecks.validate("rl", one, shop)
    assert [r["expectation"] for r in report.failed] == ["band_fills_a_grpo_step"]
    assert report.failed[0]["examples"] == [{"observed": 1}] and report.parameters["min_band"] == 2
    assert "the band holds at least 2 questions" in report.failed[0]["description"]
    assert datachecks.validate("rl", two, shop).success
    report = datachecks.run_rl_check(two, shop, None, 0.2, 0.8, min_band=3)
    assert [r["expectation"] for r in report.failed] == ["band_fills_a_grpo_step"]
    assert "band_fills_a_grpo_step" in report.to_markdown() and "- min_band: 3" in report.to_markdown()
    with pytest.raises(SlmsqlError, match="min_band"):
        configs.FilterConfig(min_band=0)


@pytest.mark.slow
def test_the_filter_fails_when_its_band_is_smaller_than_one_grpo_step(shop, tmp_path, monkeypatch):
    """`slmsql filter --min-band 3` whose band holds 2 questions (their samples half right; no model weights loaded):
    the rl data check fails the run, saying so; the report it logs carries the minimum."""
    from click.testing import CliRunner

    from slmsql.cli import main as cli
    from slmsql.generation import sampling as generation
    from slmsql.policy import models
    from slmsql.toy.tiny_model import build_tiny_model

    gold = "SELECT name FROM item WHERE kind = 'office'"
    data = write(tmp_path / "source.jsonl", [{"id": f"q{i}", "db_id": "shop", "question": "Office items?", "sql": gold}
                                             for i in range(2)])
    tiny = build_tiny_model(tmp_path / "tiny", ["Office items?", gold], vocab_size=300, hidden=16, layers=1, heads=2,
                            ffn=32)  # a real tokenizer: the prompts are counted before sampling
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(generation, "complete", lambda cfg, examples, policy, *, k, **_: [
        [f"```sql\n{gold}\n```", "```sql\nSELECT 1\n```"] * (k // 2) for _ in examples])
    result = CliRunner().invoke(cli, ["filter", "--data", str(data), "--db-root", str(shop), "--model", str(tiny),
                                      "--output-dir", str(tmp_path / "out"), "--k", "4", "--workers", "1",
                                      "--min-band", "3"])
    assert result.exit_code == 2, result.output
    assert "the rl data check failed on the filter's own output" in result.output
    assert "| **FAIL** | band_fills_a_grpo_step | the band holds at least 3 questions" in result.output
    client = mlflow.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])
    assert run.info.status == "FAILED" and run.data.metrics["band"] == 2
    report = json.loads(Path(client.download_artifacts(run.info.run_id, "data_check/rl.json")).read_text())
    assert report["parameters"]["min_band"] == 3 and not report["success"]


# ---- a run that made no optimizer step fails ------------------------------------------------------------

@pytest.mark.slow
def test_a_grpo_run_that_makes_no_optimizer_step_fails_and_its_run_is_not_finished(shop, tmp_path, monkeypatch):
    """The check let through (as if a step drew 1 question), a 1-question band at the default shape: TRL's trainer
    ends without a step, as on the machine where issue 55 was seen. The stage fails, its MLflow run ends FAILED,
    and no adapter is written in the output folder."""
    from slmsql.toy.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model", ["SELECT name FROM item WHERE price > 3"] * 8, vocab_size=300,
                             hidden=16, layers=1, heads=2, ffn=32)
    monkeypatch.setattr(configs.GRPOStageConfig, "questions_per_step",
                        lambda self, world_size=1: configs.StepDraw(1, "the check let through"))
    out = tmp_path / "grpo"
    cfg = configs.load(configs.GRPOStageConfig, None, {
        "data": str(band(tmp_path / "band.jsonl", 1)), "db_root": str(shop), "model": str(model),
        "output_dir": str(out), "max_completion_length": 8, "workers": 1, "lora_r": 2, "lora_alpha": 4})
    with pytest.raises(SlmsqlError, match=r"GRPO made no optimizer step on the RL data .*band\.jsonl \(1 question; "
                                          r"one step draws 1 \(the check let through\)\)"):
        grpo.main(cfg)
    client = mlflow.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["slmsql.stage"] == "grpo"
    assert not out.exists()


# ---- the pipeline stops there -------------------------------------------------------------------------------

class SmallBand(FakeRun):
    """test_pipeline_reuse's stand-in for `mlflow.run`, but the toy world holds conftest's `shop` database, the
    filter's band one question on it, and GRPO is the real `slmsql grpo`, started in a new process as `mlflow run`
    starts it (the entry point's command, in the run the workflow made): its exit status fails the step."""

    def __init__(self, tmp_path, shop):
        super().__init__(tmp_path)
        self.shop, self.stderr = shop, ""

    def __call__(self, uri, entry_point, env_manager, run_id, parameters, synchronous):
        from mlflow.projects import _project_spec

        client = mlflow.MlflowClient()
        if entry_point != "grpo":
            done = super().__call__(uri, entry_point, env_manager, run_id, parameters, synchronous)
            if entry_point == "toy":
                client.log_artifacts(run_id, str(self.shop), "toy/databases")
            if entry_point == "filter":
                folder = self.tmp / "bands" / run_id
                folder.mkdir(parents=True)
                client.log_artifact(run_id, str(band(folder / "band.jsonl", 1)))
            return done
        self.names.append(client.get_run(run_id).info.run_name)
        command = _project_spec.load_project(workflow.ROOT).get_entry_point(entry_point).compute_command(
            parameters, None)
        proc = subprocess.run([sys.executable, "-m", "slmsql.cli", *shlex.split(command)[1:]], cwd=workflow.ROOT,
                              env={**os.environ, "MLFLOW_RUN_ID": run_id}, capture_output=True, text=True,
                              timeout=300)
        self.stderr = proc.stderr
        if proc.returncode:  # as mlflow.projects does with a step that exits non-zero
            client.set_terminated(run_id, "FAILED")
            raise ExecutionException(f"Run (ID '{run_id}') failed")
        client.set_terminated(run_id, "FINISHED")
        return SimpleNamespace(run_id=run_id)


@pytest.mark.slow
def test_the_pipeline_stops_at_a_band_too_small_and_evaluates_nothing(shop, tmp_path, monkeypatch):
    """The filter step is given the minimum its GRPO step's shape needs (groups of 4: 4 questions a step); the GRPO
    step refuses the 1-question band in its own words (naming the filter run it came from) and fails; the pipeline
    stops there: no evaluation of the "GRPO" policy (which would be the SFT policy itself) against SFT, no
    publish."""
    monkeypatch.chdir(tmp_path)
    fake = SmallBand(tmp_path, shop)
    monkeypatch.setattr(mlflow, "run", fake)
    cfg = configs.load(configs.PipelineConfig, None, {"output_dir": str(tmp_path / "pipeline"),
                                                      "overrides": "grpo.num_generations=4"})
    with pytest.raises(ExecutionException):
        pipeline.main(cfg)
    assert fake.names == ["toy", "tiny-model", "sft", "filter", "grpo"], fake.names
    client = mlflow.MlflowClient()
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])}
    filt, grpo_run = runs["filter"], runs["grpo"]
    assert filt.data.params["min_band"] == "4"  # 16 completions a step in groups of 4
    assert grpo_run.info.status == "FAILED" and runs["pipeline"].info.status == "FAILED"
    assert not any(name.startswith(("eval-", "publish")) for name in runs)
    error = fake.stderr.strip().splitlines()[-1]
    assert f"the RL data runs:/{filt.info.run_id}/band.jsonl (from filter run {filt.info.run_id}) holds 1 question, " \
           "fewer than one optimizer step draws: 4 distinct questions (per_device_train_batch_size 16 x " \
           "gradient_accumulation_steps 1 x 1 process / num_generations 4)" in error, fake.stderr[-3000:]
    assert not (tmp_path / "pipeline" / "grpo").exists()
