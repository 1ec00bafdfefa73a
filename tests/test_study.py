"""Studies as data. Without training: the declaration's checks, the records' checks (refused by name, nothing lost),
shards, the one way to continue a study with new code, and what the project's own declarations say; refusals users
meet run from the command line in a new process. Slow: a study run for real from the command line on the tests'
tiny policy, split over two "clones" (their own folders, processes and MLflow stores, the study folder copied
between them) against one run of both cells on a real local Ray cluster, on a third clone (which makes the start's
band again, checked against the start's record), one of its cells on a worker that is killed and rerun."""

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from policy import policy_fixture  # noqa: F401  (the fixture)
from raycluster import ray_head
import watched

from slmsql import configs
from slmsql.configs import StudyRunConfig
from slmsql.errors import DataError, SlmsqlError
from slmsql.stages import study as stage
from slmsql.studies import cells, diagnosis, dispatch, leases, records, spec

YAML = """\
question: Does it work?
experiment: test-study
start:
  model: {model}
  adapter: {model}
band: {{limit: 10, data: {dev}}}
db_root: {db}
grpo: {{max_steps: 2}}
arms:
  a: {{}}
  b: {{learning_rate: 3.0e-4}}
seeds: [0, 1]
eval_sets:
  - {{name: dev, data: {dev}}}
comparisons:
  - {{arm: a}}
  - {{arm: b, against: a}}
"""


@pytest.fixture
def folder(tmp_path, shop):
    (tmp_path / "model").mkdir()
    (tmp_path / "dev.jsonl").write_text('{"id": "q1", "db_id": "shop", "question": "x", "sql": "SELECT 1"}\n')
    f = tmp_path / "studies" / "demo"
    f.mkdir(parents=True)
    (f / "study.yaml").write_text(YAML.format(model=tmp_path / "model", db=shop, dev=tmp_path / "dev.jsonl"))
    return f


def cli(*args, cwd=None):
    return watched.run([sys.executable, "-m", "slmsql.cli", "study", *args], cwd=cwd)


def cli_inline(*args, cwd):
    """`slmsql study ...` through its click command in this process (a new process costs 1-2 s of imports): for
    the variants of a refusal whose first case runs through `cli`."""
    from click.testing import CliRunner

    from slmsql.cli import main

    with contextlib.chdir(cwd):
        result = CliRunner().invoke(main, ["study", *args])
    return SimpleNamespace(returncode=result.exit_code, stderr=result.stderr)


def fake_records(study, fingerprint="f" * 64, code="c0de", cells=None):
    """A start record and cell records as `study run` writes them, with made-up results."""
    ids = [f"q{i}" for i in range(6)]
    start = records.make(study, records.START, config=study.start_config(), start={"fingerprint": fingerprint},
                         code_version=code, results={"dev": {q: [i % 2 == 0, "0" * 16] for i, q in enumerate(ids)}},
                         metrics={}, runs={})
    records.write(study, start)
    for c in cells if cells is not None else study.cells():
        rec = records.make(study, c.id, config=study.cell_config(c), start={"fingerprint": fingerprint},
                           code_version=code, results={"dev": {q: [i < 4, "1" * 16] for i, q in enumerate(ids)}},
                           metrics={}, runs={}, arm=c.arm, seed=c.seed)
        records.write(study, rec)


def snapshot(folder: Path) -> dict:
    """Every file under `folder` but the leases' locks (studies/leases.py: who runs what, not a result)."""
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and leases.FOLDER not in p.parts}


def test_the_declaration_reads_and_expands_the_family(folder):
    s = spec.load(folder)
    assert [c.id for c in s.cells()] == ["a-seed0", "a-seed1", "b-seed0", "b-seed1"]
    assert s.comparisons == [{"arm": "a", "against": "start", "eval_set": "dev"},
                             {"arm": "b", "against": "a", "eval_set": "dev"}]
    # an arm's own options win over the shared grpo section, and the config a record must carry says so
    assert s.cell_config(s.cells()[2])["grpo"]["learning_rate"] == "0.0003"
    assert s.cell_config(s.cells()[0])["grpo"]["learning_rate"] == "0.001"
    assert s.cell_config(s.cells()[0])["grpo"]["max_steps"] == "2"


@pytest.mark.parametrize("edit, line, field, says", [
    (("grpo: {max_steps: 2}", "grpo: {max_steps: 2}\nlearning_rate: 1"), 9, "learning_rate", "unknown key"),
    (("  b: {learning_rate: 3.0e-4}", "  b: {learn_rate: 3.0e-4}"), 11, "arms.b.learn_rate",
     "not an option of GRPOStageConfig"),
    (("  b: {learning_rate: 3.0e-4}", "  b: {seed: 4}"), 11, "arms.b.seed", "set by the study itself"),
    (("seeds: [0, 1]", "seeds: [0, 1, 0]"), 12, "seeds.2", "seed 0 is listed twice"),
    (("  - {arm: b, against: a}", "  - {arm: b, against: c}"), 17, "comparisons.1.against", "another declared arm"),
    (("grpo: {max_steps: 2}", "grpo: {max_steps: 0}"), 8, "grpo.max_steps", "must be >= 1"),
])
def test_a_bad_declaration_is_refused_in_process_naming_file_line_and_key(folder, edit, line, field, says):
    path = folder / "study.yaml"
    path.write_text(path.read_text().replace(*edit))
    with pytest.raises(DataError) as e:
        spec.load(folder)
    assert (e.value.path, e.value.line, e.value.field) == (path, line, field)
    assert says in str(e.value)


def test_the_start_sft_reads_the_studys_databases_and_may_not_name_others(folder, tmp_path):
    """One db_root per study: the SFT data's schemas come from it as the band's and the eval sets' do (a study on
    another world than outputs/toy must not have its SFT look for databases there)."""
    from slmsql.studies import cells
    path = folder / "study.yaml"
    text = path.read_text().replace(f"  adapter: {tmp_path / 'model'}", "  sft: {max_steps: 3}")
    path.write_text(text)
    seen = {}

    class Stop(Exception):
        pass

    class Steps:  # the stage runner, stopped at the first step: what the start's SFT is asked to do
        out = tmp_path / "out"

        def run(self, stage, name, **kw):
            seen[stage] = kw
            raise Stop

    with pytest.raises(Stop):
        cells.start(spec.load(folder), Steps(), None)
    assert Path(seen["sft"]["db_root"]) == Path(spec.load(folder).db_root).resolve()
    path.write_text(text.replace("sft: {max_steps: 3}", "sft: {max_steps: 3, db_root: elsewhere}"))
    with pytest.raises(DataError, match="set by the study itself") as e:
        spec.load(folder)
    assert e.value.field == "start.sft.db_root"


def test_an_unknown_key_is_refused_from_the_command_line_before_anything_runs(folder, tmp_path):
    path = folder / "study.yaml"
    path.write_text(path.read_text() + "budgett: {cell_minutes: 3}\n")
    before = snapshot(tmp_path)
    out = cli("run", str(folder), cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert f"{path}:18: field 'budgett': unknown key" in out.stderr
    assert "Traceback" not in out.stderr
    assert snapshot(tmp_path) == before  # no outputs, no records, no MLflow store


def test_a_missing_input_file_is_refused_naming_the_key(folder, tmp_path):
    path = folder / "study.yaml"
    path.write_text(path.read_text().replace("{name: dev, data: " + str(tmp_path / "dev.jsonl"),
                                             "{name: dev, data: " + str(tmp_path / "gone.jsonl")))
    with pytest.raises(DataError, match=r"eval_sets\.0\.data.*no such file: .*gone.jsonl"):
        spec.check_files(spec.load(folder))


@pytest.mark.parametrize("case", ["corrupt", "other start", "other code", "other config", "no such cell"])
def test_a_bad_record_is_refused_by_name_and_nothing_is_lost(folder, tmp_path, case):
    s = spec.load(folder)
    fake_records(s)
    bad = records.path_of(s, "b-seed1")
    rec = json.loads(bad.read_text())
    if case == "corrupt":
        bad.write_text(bad.read_text()[:200])
    elif case == "other start":
        rec["start"]["fingerprint"] = "e" * 64
    elif case == "other code":
        rec["code_version"] = "0ther0c0de"
    elif case == "other config":
        rec["config"]["grpo"]["learning_rate"] = "0.01"
    if case == "no such cell":
        bad = s.records / "c-seed0.json"
        bad.write_text(json.dumps({**rec, "cell": "c-seed0"}))
    elif case != "corrupt":
        bad.write_text(json.dumps(rec))
    before = snapshot(tmp_path)
    for action in ("report", "run"):  # the first case in a new process, as users meet it; the others in this one
        out = (cli if case == "corrupt" else cli_inline)(action, str(folder), cwd=tmp_path)
        assert out.returncode == 2, out.stderr
        assert str(bad) in out.stderr and "Traceback" not in out.stderr
        assert snapshot(tmp_path) == before  # the other records untouched, no report, no outputs
    says = {"corrupt": "not JSON", "other start": "from another start", "other code": "made by code 0ther0c0de",
            "other config": "learning_rate (declared '0.0003', recorded '0.01')", "no such cell": "no declared cell"}
    assert says[case] in out.stderr


@pytest.mark.slow
def test_a_pinned_start_whose_files_changed_is_refused_and_nothing_is_lost(folder, tmp_path):
    s = spec.load(folder)
    (s.pinned / "policy").mkdir(parents=True)
    (s.pinned / "policy" / "model.safetensors").write_bytes(b"weights")
    (s.pinned / "band.jsonl").write_text('{"id": "q1"}\n')
    from slmsql.workflow.steps import code_version
    fake_records(s, fingerprint=records.fingerprint(s.pinned / "policy", s.pinned / "band.jsonl")["fingerprint"],
                 cells=s.cells()[:1], code=code_version())  # this code's: the start is what is refused
    (s.pinned / "band.jsonl").write_text('{"id": "q2"}\n')  # the pinned band edited after the start was recorded
    before = snapshot(folder)
    out = cli("run", str(folder), cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert f"{records.path_of(s, records.START)}: field 'start': the start pinned in" in out.stderr
    assert "is not the one the study's records come from" in out.stderr and "Traceback" not in out.stderr
    assert snapshot(folder) == before


def test_new_code_pools_only_once_the_study_says_so(folder):
    s = spec.load(folder)
    fake_records(s, code="c0de")
    rec = json.loads(records.path_of(s, "b-seed1").read_text())
    records.path_of(s, "b-seed1").write_text(json.dumps({**rec, "code_version": "n3wc0de"}))
    with pytest.raises(DataError, match="made by code n3wc0de"):
        records.read(s)
    path = folder / "study.yaml"
    path.write_text(path.read_text() + "continue_with:\n  - {code_version: n3wc0de}\n")
    with pytest.raises(DataError, match="give both code_version and reason"):
        spec.load(folder)
    path.write_text(path.read_text().replace("{code_version: n3wc0de}",
                                             "{code_version: n3wc0de, reason: a docs-only change}"))
    start, cells = records.read(spec.load(folder))
    assert sorted(cells) == ["a-seed0", "a-seed1", "b-seed0", "b-seed1"]


def test_an_option_added_after_a_record_pools_only_at_its_default(folder):
    """A record made before a stage gained an option lacks it: at the option's default it is what that code did,
    and the record pools; declared otherwise, the record is refused, naming the option."""
    s = spec.load(folder)
    fake_records(s)
    path = records.path_of(s, "a-seed0")
    rec = json.loads(path.read_text())
    del rec["config"]["grpo"]["merged_rollouts"], rec["config"]["evaluate"]["limit"]  # as older code wrote it
    path.write_text(json.dumps(rec))
    assert records.read(s)[1]["a-seed0"]["config"] == rec["config"]  # read as recorded, not rewritten
    study = folder / "study.yaml"
    study.write_text(study.read_text().replace("grpo: {max_steps: 2}", "grpo: {max_steps: 2, merged_rollouts: true}"))
    with pytest.raises(DataError, match=r"grpo\.merged_rollouts \(declared 'true', recorded None\)") as e:
        records.read(spec.load(folder))
    assert e.value.path == path


def test_shards_split_the_declared_cells_and_run_only_what_is_missing(folder):
    s = spec.load(folder)
    shares = [stage.todo(s, {}, StudyRunConfig(study=str(folder), shard=f"{k}/3")) for k in (1, 2, 3)]
    ids = [[c.id for c in share] for share in shares]
    assert sorted(sum(ids, [])) == sorted(c.id for c in s.cells())  # each cell in exactly one share
    # a cell's share is a hash of its id alone (sha256, its first 12 hex digits, mod N, plus 1)
    assert ids == [["a-seed0"], ["a-seed1", "b-seed0", "b-seed1"], []]
    path = folder / "study.yaml"  # an arm added before the others: no declared cell moves to another share
    path.write_text(path.read_text().replace("arms:\n", "arms:\n  c: {learning_rate: 1.0e-4}\n"))
    grown = spec.load(folder)
    assert [c.id for c in grown.cells()][:2] == ["c-seed0", "c-seed1"]
    for k in (1, 2, 3):
        now = [c.id for c in stage.todo(grown, {}, StudyRunConfig(study=str(folder), shard=f"{k}/3"))]
        assert [c for c in now if not c.startswith("c-")] == ids[k - 1]
    done = {"a-seed1": {}}
    assert [c.id for c in stage.todo(s, done, StudyRunConfig(study=str(folder), shard="2/3"))] == ["b-seed0",
                                                                                                 "b-seed1"]
    assert [c.id for c in stage.todo(s, done, StudyRunConfig(study=str(folder)))] == ["a-seed0", "b-seed0",
                                                                                      "b-seed1"]
    with pytest.raises(DataError, match="no such cell"):
        stage.todo(s, done, StudyRunConfig(study=str(folder), cells=["a-seed7"]))
    for bad in ("0/2", "3/2", "1-2"):
        with pytest.raises(DataError, match="K/N"):
            StudyRunConfig(study=str(folder), shard=bad)


def test_a_record_is_written_once(folder):
    s = spec.load(folder)
    fake_records(s, cells=[])
    rec = records.make(s, "a-seed0", config=s.cell_config(s.cells()[0]), start={"fingerprint": "f" * 64},
                       code_version="c0de", results={"dev": {}}, metrics={"x": 1}, runs={}, arm="a", seed=0)
    first = records.write(s, rec).read_bytes()
    with pytest.raises(records.Lost, match="written by another run first"):  # said, not "recorded"
        records.write(s, {**rec, "metrics": {"x": 2}})  # a second finisher: the first record stands
    assert records.path_of(s, "a-seed0").read_bytes() == first
    assert not list(s.records.glob(".*.tmp"))


def test_a_records_diagnosis_is_optional_and_checked_when_there(folder):
    s = spec.load(folder)
    fake_records(s)  # made as older code made them: no diagnosis, and read all the same
    assert all("diagnosis" not in rec for rec in records.read(s)[1].values())
    path = records.path_of(s, "a-seed1")
    rec = json.loads(path.read_text())
    good = dict.fromkeys(diagnosis.KEYS, None) | {"logged_steps": 20, "pass_first10": 0.25}
    path.write_text(json.dumps({**rec, "diagnosis": good}))
    assert records.read(s)[1]["a-seed1"]["diagnosis"] == good
    older = {k: v for k, v in good.items() if k not in diagnosis.TELEMETRY}  # made before the seed's telemetry
    path.write_text(json.dumps({**rec, "diagnosis": older}))
    assert records.read(s)[1]["a-seed1"]["diagnosis"] == older
    for bad, where in (({**good, "zero_std": "25%"}, "field 'diagnosis.zero_std': corrupt record: expected a "
                                                      "number or null, got '25%'"),
                       ({**good, "pass_first10": True}, "field 'diagnosis.pass_first10'"),
                       ({k: v for k, v in good.items() if k != "draws_min"}, "field 'diagnosis': corrupt record"),
                       ({k: v for k, v in good.items() if k != "grad_norm"}, "field 'diagnosis': corrupt record"),
                       ({**good, "lora": 1.0}, "field 'diagnosis': corrupt record")):
        path.write_text(json.dumps({**rec, "diagnosis": bad}))
        with pytest.raises(DataError, match=f"^{re.escape(str(path))}: {re.escape(where)}"):
            records.read(s)


class FakeSteps:
    """`workflow.Steps` without MLflow: a GRPO step writes what TRL leaves in its output folder (a checkpoint's
    training log, the logged prompts), an evaluation's results say q0 and q1 right."""

    def __init__(self, out: Path, log: list, drawn: list):
        from slmsql.workflow.steps import code_version

        self.out, self.version, self.log, self.drawn = out, code_version(), log, drawn

    def run(self, stage, name, tags=None, **params):
        import pandas as pd

        if stage == "grpo":
            grpo = Path(params["output_dir"])
            (grpo / "checkpoint-2").mkdir(parents=True)
            (grpo / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"log_history": self.log}))
            (grpo / "completions").mkdir()
            prompt = lambda q: [{"role": "user", "content": f"Database schema:\n...\n\nQuestion: {q}\n"}]  # noqa: E731
            pd.DataFrame({"step": range(1, len(self.drawn) + 1), "prompt": [prompt(q) for q in self.drawn]}).to_parquet(
                grpo / "completions" / "completions_00001.parquet")
        return SimpleNamespace(info=SimpleNamespace(run_id=f"{stage}-{name}"), data=SimpleNamespace(metrics={}, params={k: str(v) for k, v in params.items()}))

    def uri(self, run, path):
        return f"runs:/{run.info.run_id}/{path}"

    def artifact(self, run, path):
        out = self.out / run.info.run_id / path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps({"id": f"q{i}", "correct": i < 2, "predicted_sql": "SELECT 1"}) + "\n"
                               for i in range(6)))
        return str(out)


class RecordingSteps(FakeSteps):
    """FakeSteps that keep the (stage, params) of each step they are asked to run, in order."""

    def __init__(self, out: Path, log=(), drawn=()):
        super().__init__(out, list(log), list(drawn))
        self.ran = []

    def run(self, stage, name, tags=None, **params):
        self.ran.append((stage, params))
        return super().run(stage, name, tags, **params)


def test_a_cell_records_the_diagnosis_of_its_grpo_runs_training_log(folder, tmp_path):
    """The wiring of `study run` (no training): a cell's record carries what studies/diagnosis.py reads from the
    folder its GRPO step wrote, the band's questions counted in its logged prompts."""
    s = spec.load(folder)
    band = tmp_path / "band.jsonl"
    band.write_text("".join(json.dumps({"id": f"b{i}", "question": q}) + "\n" for i, q in enumerate(["x?", "y?"])))
    log = [{"exec/correct": c, "frac_reward_zero_std": 0.5, "completions/clipped_ratio": 0.0, "reward_std": 0.1 * (i % 2),
            "grad_norm": 0.25 if i < 10 else 0.75, "completions/mean_length": 20 + i}
           for i, c in enumerate([0.0] * 10 + [1.0] * 10)] + [{"train_runtime": 1.0}]
    steps = FakeSteps(tmp_path / "work", log, drawn=["x?", "x?", "y?"])
    start = records.make(s, records.START, config=s.start_config(), start={"fingerprint": "f" * 64},
                         code_version=steps.version, results={}, metrics={}, runs={})
    rec = cells.cell(s, steps, s.cells()[0], cells.Start(str(folder.parent.parent / "model"), str(band), start))
    assert rec["diagnosis"] == pytest.approx({
        "logged_steps": 20, "pass_first10": 0.0, "pass_last10": 1.0, "groups_vary": None, "zero_std": 0.5,
        "cut_first10": 0.0, "cut_last10": 0.0, "reward_std": 0.05, "grad_norm": 0.5, "length": 29.5, "draws_min": 1,
        "draws_max": 2})  # the seed's telemetry: means over the 20 logged steps (0.1 on every other; 20..39 tokens)
    records.write(s, start)
    records.write(s, rec)
    assert records.read(s)[1]["a-seed0"]["diagnosis"] == rec["diagnosis"]  # what it writes, it reads back
    # a folder without a log or logged prompts: nothing known, not "drawn 0 times"
    assert diagnosis.of_run(tmp_path / "gone", {"b0": {"question": "x?"}}) == {
        **dict.fromkeys(diagnosis.KEYS), "logged_steps": 0}


def test_the_fingerprint_is_of_the_weights_and_the_band(tmp_path):
    policy, band = tmp_path / "policy", tmp_path / "band.jsonl"
    policy.mkdir()
    (policy / "adapter_model.safetensors").write_bytes(b"w1")
    (policy / "adapter_config.json").write_text("{}")
    band.write_text("a\n")
    fp = records.fingerprint(policy, band)
    import hashlib
    assert fp["band_sha256"] == hashlib.sha256(b"a\n").hexdigest()
    (policy / "adapter_config.json").write_text('{"x": 1}')  # not weights: the same start
    assert records.fingerprint(policy, band) == fp
    (policy / "adapter_model.safetensors").write_bytes(b"w2")
    assert records.fingerprint(policy, band)["fingerprint"] != fp["fingerprint"]
    (policy / "adapter_model.safetensors").unlink()
    with pytest.raises(DataError, match="no weights"):
        records.fingerprint(policy, band)


# ---- the studies this project declares (studies/*/study.yaml): what each declaration says ------------------

ROOT = Path(__file__).resolve().parents[1]


def declared(name: str) -> spec.Study:
    return spec.load(ROOT / "studies" / name)


def test_every_declared_study_reads(monkeypatch):
    monkeypatch.chdir(ROOT)
    names = sorted(p.parent.name for p in (ROOT / "studies").glob("*/study.yaml"))
    assert {"toy-control", "toy-rewards", "toy-study", "toy-transfer-200", "smollm2-transfer"} <= set(names)
    for name in names:
        s = spec.load(ROOT / "studies" / name)
        assert s.question and s.cells() and s.comparisons


def test_the_control_is_one_comparison_on_the_band_of_a_start_with_headroom(monkeypatch):
    monkeypatch.chdir(ROOT)
    s = declared("toy-control")
    assert 0 < s.sft["max_steps"] < configs.SFTStageConfig().max_steps and s.pin  # stopped short, pinned
    assert (s.band["low"], s.band["high"], s.band["limit"]) == (0.1, 0.9, 0)  # every question 1-7 of 8 right
    assert [es.data for es in s.eval_sets] == [spec.BAND] and len(s.comparisons) == 1  # a Holm family of 1
    assert len(s.seeds) == 3 and not {100, 101} & set(s.seeds)  # none of its pilot's seeds


def test_the_reward_sets_are_the_reward_recipes_on_the_controls_start_and_length(monkeypatch):
    monkeypatch.chdir(ROOT)
    s, control = declared("toy-rewards"), declared("toy-control")
    assert s.start_from.endswith("toy-control") and s.seeds == control.seeds
    keys = ("rewards", "reward_weights", "runs_tier", "format_tier")
    for arm in ("outcome", "dense", "qatch"):
        cfg = s.grpo_config(arm)
        recipe = configs.load(configs.GRPOStageConfig, f"recipes/rewards/{arm}.yaml", require=False)
        assert [getattr(cfg, k) for k in keys] == [getattr(recipe, k) for k in keys]
        ctl = control.grpo_config("grpo")  # as long and at the rate the control trains
        assert (cfg.max_steps, cfg.learning_rate) == (ctl.max_steps, ctl.learning_rate) == (600, 3e-4)


def test_the_200_step_run_is_on_fresh_seeds_from_the_toy_studys_start(monkeypatch):
    monkeypatch.chdir(ROOT)
    s, toy = declared("toy-transfer-200"), declared("toy-study")
    assert s.start_from.endswith("toy-study") and not set(s.seeds) & set(toy.seeds)
    assert s.grpo_config("grpo").max_steps == 200 and toy.grpo_config("defaults").max_steps == 50


# ---- a study run for real (slow) ---------------------------------------------------------------------------

HERE = Path(__file__).parent
CELLS = ["a-seed0", "a-seed1"]

RUN_YAML = """\
question: Does a two-step GRPO move the tiny policy?
experiment: study-test
start: {{model: {model}, adapter: {model}, pin: true}}
band: {{data: {source}, k: 4, low: 0.1, high: 0.9}}
db_root: {db}
grpo: {{max_steps: 2, num_generations: 4, per_device_train_batch_size: 8, save_steps: 100}}
evaluate: {{batch_size: 32}}
arms: {{a: {{}}}}
seeds: [0, 1]
eval_sets: [{{name: dev, data: {dev}}}, {{name: band-seen, data: band}}]
budget: {{cpus_per_cell: 1}}
"""


def clone(root: Path, policy) -> Path:
    """A machine's checkout: its own folder, holding the study's declaration (as committed) and nothing else."""
    folder = root / "studies" / "s"
    folder.mkdir(parents=True)
    (folder / "study.yaml").write_text(RUN_YAML.format(model=policy.model, source=policy.source, db=policy.db_root,
                                                   dev=policy.dev))
    return root


def slmsql(root: Path, *args, script=None):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_EXPERIMENT")},
           "MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, *([str(script)] if script else ["-m", "slmsql.cli"]), *args]
    done = watched.run(cmd, cwd=root, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def results(root: Path) -> dict:
    s = spec.load(root / "studies" / "s")
    start, cells = records.read(s)
    return {"start": (start["start"], start["results"]), **{k: v["results"] for k, v in cells.items()}}


def stage_runs(root: Path, stage: str) -> int:
    import sqlite3

    with contextlib.closing(sqlite3.connect(root / "mlflow.db")) as con:
        return con.execute("SELECT count(*) FROM tags WHERE key = 'slmsql.stage' AND value = ?", (stage,)).fetchone()[0]


@pytest.fixture(scope="module")
def machines(policy, tmp_path_factory):
    """Three machines' checkouts. `a` and `b` split the study (`a` takes a-seed0's share, then `b` a-seed1's, given
    the study folder as `a` committed it: the declaration, the records, the pinned start). `r` runs both cells in
    one invocation on a real Ray cluster, given the start's record but not its pinned files: it makes the band again
    from scratch, which the run checks against the record's fingerprint (refused if it differed), evaluates the
    start no more (its results are in the record), and one of its cells runs on a worker killed mid-cell
    (study_faults.py)."""
    tmp = tmp_path_factory.mktemp("machines")
    a, b, r = (clone(tmp / n, policy) for n in ("a", "b", "r"))
    # a cell's share is a hash of its id (stages/study.py share()): sha256("a-seed0") puts it in share 2 of 2,
    # "a-seed1" in share 1
    out = {"a": slmsql(a, "study", "run", "studies/s", "--shard", "2/2")}
    shutil.rmtree(b / "studies" / "s")
    shutil.copytree(a / "studies" / "s", b / "studies" / "s")
    out["b"] = slmsql(b, "study", "run", "studies/s", "--shard", "1/2")
    shutil.copy(b / "studies/s/records/a-seed1.json", a / "studies/s/records/a-seed1.json")
    (r / "studies/s/records").mkdir()
    shutil.copy(a / "studies/s/records/start.json", r / "studies/s/records/start.json")
    with ray_head(tmp / "head.log", env={**os.environ, "OMP_NUM_THREADS": "1"}) as (_, port):
        out["r"] = slmsql(r, CELLS[1], "study", "run", "studies/s", "--ray-address", f"127.0.0.1:{port}",
                          script=HERE / "study_faults.py")
    # (the cluster is stopped and none of its processes left: raycluster.py)
    return SimpleNamespace(a=a, b=b, r=r, out=out)


def finished(root: Path, stage: str) -> list[str]:
    """The `slmsql.cell` tag of each FINISHED run of `stage` in root's store."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(root / "mlflow.db")) as con:
        return sorted(v for (v,) in con.execute(
            "SELECT t.value FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid AND t.key = 'slmsql.cell' "
            "JOIN tags g ON g.run_uuid = r.run_uuid AND g.key = 'slmsql.stage' AND g.value = ? "
            "WHERE r.status = 'FINISHED'", (stage,)))


@pytest.mark.slow
def test_a_study_split_over_two_clones_gives_what_one_run_gives(machines):
    a, b, r, out = machines.a, machines.b, machines.r, machines.out
    assert "[1/1] cell a-seed0 recorded" in out["a"].stdout and "missing: a-seed1" in out["a"].stdout
    assert "[1/1] cell a-seed1 recorded" in out["b"].stdout
    assert (stage_runs(b, "filter"), stage_runs(b, "evaluate"), stage_runs(b, "grpo")) == (0, 2, 1)  # no start remade
    # the one run: the band made again once, the start not evaluated again, each cell trained and evaluated once
    assert stage_runs(r, "filter") == 1
    assert finished(r, "grpo") == CELLS and finished(r, "evaluate") == sorted(CELLS * 2)
    assert results(a) == results(r)
    assert results(b)["a-seed1"] == results(r)["a-seed1"]
    # rerunning with every record present runs nothing, and the report comes from the records alone: the same as
    # the one run wrote
    store = (a / "mlflow.db").read_bytes()
    assert "this run: 0 cell(s)" in slmsql(a, "study", "run", "studies/s").stdout
    os.remove(a / "mlflow.db")
    slmsql(a, "study", "report", "studies/s")
    rep = {m: json.loads((m / "studies/s/report.json").read_text()) for m in (a, r)}
    assert rep[a]["rows"] == rep[r]["rows"] and rep[a]["missing"] == [] and len(rep[a]["rows"]) == 2
    assert (a / "studies/s/report.md").read_text() == (r / "studies/s/report.md").read_text()
    assert store  # (the store a rerun would have reused existed; the report needed none)


@pytest.mark.slow
def test_a_killed_cell_is_rerun_and_recorded_once_on_a_real_ray_cluster(machines):
    root, out = machines.r, machines.out["r"]
    cell_dir = root / "outputs/studies/s/cells" / CELLS[1]
    dead_group = int((cell_dir / "killed-once").read_text())  # the first attempt did die mid-cell
    with pytest.raises(ProcessLookupError):  # and nothing it started is left running
        os.killpg(dead_group, 0)
    assert sorted(p.name for p in (root / "studies/s/records").glob("*.json")) == ["a-seed0.json", "a-seed1.json",
                                                                                   "start.json"]
    assert out.stdout.count("cell a-seed1 recorded") == 1 and "2 of 2 cells recorded" in out.stdout
    # each cell trained by exactly one finished GRPO run (the killed attempt's never finished)
    assert finished(root, "grpo") == CELLS


def test_the_transfer_study_is_the_pilots_length_with_the_reward_sets_on_held_out_sets_sized_for_power(monkeypatch):
    """issue 48's declaration: the long pilot's GRPO (3 passes) with each reward recipe, 3 seeds, one family of 6
    comparisons on two held-out sets of 900 questions; 900 is what a paired test at alpha 0.05 / 6 needs for 80%
    power at +4 points where 11.5% of questions change (the pilot's toy-dev_cross), by the textbook normal
    approximation (var of a -1/0/1 difference = q - delta^2), not by slmsql's own planner."""
    from scipy.stats import norm
    monkeypatch.chdir(ROOT)
    s = declared("smollm2-transfer")
    assert s.pin and s.evaluate["limit"] == 900 and len(s.seeds) == 3 and 100 not in s.seeds  # the pilot's seed
    # the long pilot's GRPO (its folder retired, docs/studies.md): the SmolLM2 recipe, 3 passes over the band
    long = dataclasses.replace(configs.load(configs.GRPOStageConfig, "recipes/smollm2-135m/grpo.yaml", require=False),
                               max_steps=-1, num_train_epochs=3)
    rewards = ("rewards", "reward_weights", "runs_tier", "format_tier")
    for arm in ("outcome", "dense", "qatch"):
        cfg = s.grpo_config(arm)
        recipe = configs.load(configs.GRPOStageConfig, f"recipes/rewards/{arm}.yaml", require=False)
        assert [getattr(cfg, k) for k in rewards] == [getattr(recipe, k) for k in rewards]
        differ = {f.name for f in configs.fields(cfg) if getattr(cfg, f.name) != getattr(long, f.name)}
        assert differ <= {*rewards, "merged_rollouts"} and cfg.merged_rollouts  # the pilot's training, 3 passes,
        # with the rollouts sampled merged (the same policy, faster: bench/README.md)
    held_out = ["toy-large-dev", "toy-large-dev_cross"]
    assert [(c["arm"], c["against"], c["eval_set"]) for c in s.comparisons] == [
        (arm, against, es) for arm, against in (("outcome", "start"), ("dense", "outcome"), ("qatch", "outcome"))
        for es in held_out]

    def power(n, q=0.115, delta=0.04, family=6):
        return norm.cdf(delta / ((q - delta ** 2) / n) ** 0.5 - norm.ppf(1 - 0.05 / family / 2))
    assert power(900) >= 0.8 > power(787)


@pytest.mark.slow
def test_the_transfer_studys_held_out_sets_share_nothing_with_its_band(tmp_path):
    """toy-large's dev asks questions no training split asks, dev_cross about databases none touches: the
    band (the first 300 rl_source questions) and the SFT data never saw the first 900 of either."""
    from slmsql.inputs.data import read_jsonl
    from slmsql.toy.world import generate
    generate(tmp_path / "w", seed=0, size="large")
    rows = {split: read_jsonl(tmp_path / "w" / f"{split}.jsonl") for split in ("sft", "rl_source", "dev", "dev_cross")}
    band, sft = rows["rl_source"][:300], rows["sft"]
    seen = {(r["db_id"], r["question"]) for r in band + sft} | {(r["db_id"], r["sql"]) for r in band + sft}
    dev, cross = rows["dev"][:900], rows["dev_cross"][:900]
    assert not seen & ({(r["db_id"], r["question"]) for r in dev} | {(r["db_id"], r["sql"]) for r in dev})
    assert not {r["db_id"] for r in band + sft} & {r["db_id"] for r in cross}
    assert len({r["db_id"] for r in cross}) == 45 and len({r["db_id"] for r in dev}) > 300


def amend(folder: Path, digest: str, reason="the family narrowed", date="2026-12-05") -> None:
    path = folder / "study.yaml"
    path.write_text(path.read_text()
                    + f"amendments:\n  - {{declaration: '{digest}', reason: {reason}, date: {date}}}\n")


@pytest.mark.parametrize("change, names", [
    ("family", "comparisons"), ("alpha", "alpha"), ("eval file", "eval_sets.dev.data.sha256"),
    ("eval path", "eval_sets.dev.data.path"), ("databases", "db_root.sha256, eval_sets.dev.db_root.sha256")])
def test_a_declaration_changed_after_its_records_is_refused_by_name_until_amended(folder, tmp_path, change, names):
    """The Holm family, alpha, an eval set's file and the databases are bound into the start's record: a change
    after it is refused, naming what changed, until an amendment accepts the new declaration's hash; the report
    then lists the amendment."""
    s = spec.load(folder)
    fake_records(s)
    path = folder / "study.yaml"
    text = path.read_text()
    if change == "family":
        path.write_text(text.replace("  - {arm: b, against: a}\n", ""))
    elif change == "alpha":
        path.write_text(text + "alpha: 0.1\n")
    elif change == "eval file":
        (tmp_path / "dev.jsonl").write_text('{"id": "q9", "db_id": "shop", "question": "y", "sql": "SELECT 2"}\n')
    elif change == "eval path":
        shutil.copy(tmp_path / "dev.jsonl", tmp_path / "same.jsonl")
        path.write_text(text.replace(f"name: dev, data: {tmp_path / 'dev.jsonl'}",
                                     f"name: dev, data: {tmp_path / 'same.jsonl'}"))
    elif change == "databases":  # a database added to shop's suite (a file that is no database changes nothing)
        (Path(s.db_root) / "shop" / "notes.txt").write_text("not a database: read by no stage")
        records.read(spec.load(folder))
        shutil.copy(Path(s.db_root) / "shop" / "shop.sqlite", Path(s.db_root) / "shop" / "shop_1.sqlite")
    with pytest.raises(DataError, match="differs from the declaration its records were made under") as e:
        records.read(spec.load(folder))
    assert e.value.path == records.path_of(s, records.START) and e.value.field == "declaration"
    assert re.search(rf": {re.escape(names)}\. ", str(e.value)), str(e.value)
    digest = re.search(r"declaration: '([0-9a-f]{16})'", str(e.value))[1]
    amend(folder, "0" * 16)  # an amendment of another declaration accepts nothing
    with pytest.raises(DataError, match="differs from the declaration"):
        records.read(spec.load(folder))
    path.write_text(path.read_text().replace("0" * 16, digest))
    start, cells = records.read(spec.load(folder))
    assert len(cells) == 4
    rep = stage.write_report(spec.load(folder), start, cells)
    assert rep["amendments"] == [{"declaration": digest, "reason": "the family narrowed", "date": "2026-12-05"}]
    assert f"- 2026-12-05: declaration `{digest}`: the family narrowed" in (folder / "report.md").read_text()


def test_an_unchanged_declaration_reads_and_a_changed_one_is_refused_from_the_command_line(folder, tmp_path):
    s = spec.load(folder)
    fake_records(s)
    assert records.read(spec.load(folder))[0]["declaration"]["sha256"] == records.read(s)[0]["declaration"]["sha256"]
    path = folder / "study.yaml"
    path.write_text(path.read_text().replace("  - {arm: b, against: a}\n", ""))
    before = snapshot(tmp_path)
    out = cli("report", str(folder.resolve()), cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert f"{records.path_of(s, records.START)}: field 'declaration':" in out.stderr
    assert "comparisons" in out.stderr and "Traceback" not in out.stderr
    assert snapshot(tmp_path) == before  # no report written


def test_a_start_recorded_before_the_binding_reads_unbound_and_is_bound_once(folder):
    """A record from before the binding (the committed studies') reads as it is, and its report says the
    declaration is unbound; `records.bind` (what `study run` does first) adds the declaration, once, and from then
    on a change is refused."""
    s = spec.load(folder)
    fake_records(s)
    path = records.path_of(s, records.START)
    old = json.loads(path.read_text())
    del old["declaration"]
    path.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
    start, cells = records.read(s)
    rep = stage.write_report(s, start, cells)
    assert rep["declaration"] is None and "not bound to the records" in (folder / "report.md").read_text()
    bound = records.bind(s, start)
    assert {k: v for k, v in bound.items() if k != "declaration"} == old
    assert json.loads(path.read_text()) == bound
    assert records.bind(s, records.read(s)[0]) == bound  # once
    (folder / "study.yaml").write_text((folder / "study.yaml").read_text() + "alpha: 0.01\n")
    with pytest.raises(DataError, match=r"made under: alpha\."):
        records.read(spec.load(folder))


def test_cells_and_shard_together_are_refused_from_the_command_line(folder, tmp_path):
    out = cli("run", str(folder), "--shard", "1/2", "--cells", "a-seed0", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "field 'cells': give --cells or --shard, not both" in out.stderr and "Traceback" not in out.stderr
    assert not (folder / "records").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("key, value, field, says", [
    ("start", "[]", "start", "is not of type 'object'"), ("config", '"x"', "config", "is not of type 'object'"),
    ("start", "{}", "start.fingerprint", "key missing"), ("results", '{"dev": {"q0": [1, "h"]}}', "results.dev.q0.0",
                                                           "is not of type 'boolean'"),
    ("seed", "true", "seed", "is not of type 'integer', 'null'"), ("shard", '"half"', "shard", "does not match")])
def test_a_record_of_the_wrong_shape_is_refused_naming_file_and_field(folder, key, value, field, says):
    s = spec.load(folder)
    fake_records(s)
    path = records.path_of(s, "a-seed1")
    rec = json.loads(path.read_text())
    path.write_text(json.dumps({**rec, key: json.loads(value)}))
    with pytest.raises(DataError, match=re.escape(says)) as e:
        records.read(s)
    assert (e.value.path, e.value.field) == (path, field)


def test_seeds_must_be_whole_numbers_not_booleans(folder):
    path = folder / "study.yaml"
    path.write_text(path.read_text().replace("seeds: [0, 1]", "seeds: [true]"))
    with pytest.raises(DataError, match="expected a list of whole numbers") as e:
        spec.load(folder)
    assert e.value.field == "seeds"


def test_a_cycle_of_start_from_is_refused_by_name(tmp_path, folder):
    one, two = tmp_path / "studies" / "one", tmp_path / "studies" / "two"
    for me, other in ((one, two), (two, one)):
        me.mkdir(parents=True)
        (me / "study.yaml").write_text((folder / "study.yaml").read_text().split("start:")[0]
                                       + f"start: {{from: {other}}}\narms: {{a: {{}}}}\nseeds: [0]\n"
                                       + "eval_sets: [{name: dev, data: band}]\n")
    with pytest.raises(DataError, match="a cycle of start.from: .*one -> .*two -> .*one") as e:
        spec.load(one)
    assert e.value.field == "start.from"


@pytest.mark.slow
def test_a_report_is_made_from_any_folder_and_from_a_renamed_study_folder(tmp_path):
    """`study report` of a committed study (recipes and start.from relative to the project) from a folder that is
    not the project's, and of a copy of it under another name: the same numbers."""
    from slmsql.workflow.steps import ROOT

    copy = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(ROOT / "studies" / "toy-transfer-200", copy)  # start.from: studies/toy-study
    out = cli("report", str(copy), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    from slmsql.studies import report as reporting

    original = spec.load(ROOT / "studies" / "toy-transfer-200")
    start, done = records.read(original)
    theirs = reporting.build(original.as_dict(), start, list(done.values()))  # in the project, under its own name
    mine = json.loads((copy / "report.json").read_text())
    assert mine["rows"] == json.loads(json.dumps(theirs["rows"])) and mine["study"] == "renamed"


def test_the_report_says_when_cells_of_different_float_paths_pool(folder):
    s = spec.load(folder)
    fake_records(s)
    path = records.path_of(s, "b-seed1")
    rec = json.loads(path.read_text())
    path.write_text(json.dumps({**rec, "float_path": {**rec["float_path"], "threads": "7"}}))
    rep = stage.write_report(s, *records.read(s))
    assert rep["float_paths"] == 2
    assert "2 float path(s), 1 code version(s). Cells from different float paths pool" in (
        folder / "report.md").read_text()


def test_arms_that_differ_only_in_case_are_refused(folder):
    path = folder / "study.yaml"
    path.write_text(path.read_text().replace("  b: {learning_rate: 3.0e-4}", "  A: {learning_rate: 3.0e-4}")
                    .replace("{arm: b, against: a}", "{arm: A, against: a}"))
    with pytest.raises(DataError, match="differs from arm 'a' only in case") as e:
        spec.load(folder)
    assert e.value.field == "arms.A"


RACER = """
import sys, time
from pathlib import Path
from slmsql.studies import leases, records, spec
what, folder, go = sys.argv[1], sys.argv[2], Path(sys.argv[3])
if what == "lease":
    try:
        with leases.lease(folder, "a-seed0"):
            print("got", flush=True)
            while not go.exists():
                time.sleep(0.05)
    except leases.Busy as e:
        print("busy:", e, flush=True)
else:
    s = spec.load(folder)
    rec = records.make(s, "a-seed0", config=s.cell_config(s.cells()[0]), start={"fingerprint": "f" * 64},
                       code_version="c0de", results={"dev": {}}, metrics={"by": what}, runs={}, arm="a", seed=0)
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.01)
    try:
        records.write(s, rec)
        print("won", flush=True)
    except records.Lost as e:
        print("lost:", e, flush=True)
"""


def racer(what, folder, go):
    return subprocess.Popen([sys.executable, "-c", RACER, what, str(folder), str(go)], stdout=subprocess.PIPE,
                            text=True)


def test_two_processes_racing_for_a_cell_one_holds_its_lease_until_it_ends(folder, tmp_path):
    """A cell's lease is held by one process; another is refused naming its holder; a holder killed with SIGKILL
    leaves no stale lease (the system drops the lock with the process)."""
    go = tmp_path / "go"
    first = racer("lease", folder, go)
    assert first.stdout.readline() == "got\n"
    second = racer("lease", folder, go)
    out = second.communicate(timeout=watched.STALL_S)[0]
    assert out.startswith("busy: cell a-seed0 is being run by another process") and f"pid {first.pid}" in out
    first.kill()
    first.wait()
    third = racer("lease", folder, go)
    assert third.stdout.readline() == "got\n"
    go.touch()
    assert third.wait(timeout=watched.STALL_S) == 0


@pytest.mark.slow
def test_two_processes_writing_one_record_one_wins_and_the_other_is_told(folder, tmp_path):
    s = spec.load(folder)
    go = tmp_path / "go"
    procs = [racer(f"writer{i}", folder, go) for i in (1, 2)]
    assert [p.stdout.readline() for p in procs] == ["ready\n"] * 2
    go.touch()
    outs = sorted(p.communicate(timeout=watched.STALL_S)[0] for p in procs)
    assert outs[0].startswith("lost: ") and "written by another run first" in outs[0] and outs[1] == "won\n"
    winner = json.loads(records.path_of(s, "a-seed0").read_text())["metrics"]["by"]
    assert winner in ("writer1", "writer2") and not list(s.records.glob(".*.tmp"))


def test_a_cell_whose_lease_another_process_holds_is_skipped_here(folder, tmp_path, monkeypatch):
    """`study run` here: a cell another run holds is not trained, and said; the others are recorded."""
    s = spec.load(folder)
    fake_records(s, cells=[])
    trained = []

    def cell(study, steps, c, st):
        trained.append(c.id)
        return records.make(study, c.id, config=study.cell_config(c), start={"fingerprint": "f" * 64},
                            code_version="c0de", results={"dev": {}}, metrics={}, runs={}, arm=c.arm, seed=c.seed)

    monkeypatch.setattr(cells, "cell", cell)
    go = tmp_path / "go"
    holder = racer("lease", folder, go)  # holds a-seed0
    assert holder.stdout.readline() == "got\n"
    said = []
    dispatch.here(s, s.cells(), None, None, lambda c, path, why="": said.append((c.id, path, why)), shard="1/1")
    go.touch()
    holder.wait(timeout=watched.STALL_S)
    assert trained == ["a-seed1", "b-seed0", "b-seed1"]
    assert said[0][:2] == ("a-seed0", None) and "is being run by another process" in said[0][2]
    assert [x[1] for x in said[1:]] == [records.path_of(s, c) for c in trained]
    assert json.loads(records.path_of(s, "b-seed1").read_text())["shard"] == "1/1"


class SerialRay:
    """Ray's calls `dispatch.on_ray` makes, run in this process one task at a time (a task's error comes out of
    `get`, as Ray's does): the dispatch's own logic without a cluster (test_a_killed_cell_... has the real one)."""

    def __init__(self):
        self.calls = {}

    def init(self, **_):
        pass

    def shutdown(self):
        pass

    def remote(self, **_):
        def task(fn):
            def submit(*args):
                ref = object()
                self.calls[ref] = (fn, args)
                return ref
            return SimpleNamespace(remote=submit)
        return task

    def wait(self, refs, num_returns):
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref):
        fn, args = self.calls[ref]
        return fn(*args)


@pytest.mark.parametrize("reuse", [True, False])
def test_on_ray_a_failed_cell_stops_no_other_and_reuse_reaches_every_task(folder, monkeypatch, reuse):
    s = spec.load(folder)
    fake_records(s, cells=[])
    got = []

    def task(cwd, folder_, cell_id, policy, band, workdir, env, reuse_):
        got.append((cell_id, reuse_))
        if cell_id == "a-seed1":
            raise RuntimeError("the worker's cell failed")
        c = next(c for c in s.cells() if c.id == cell_id)
        return records.make(s, c.id, config=s.cell_config(c), start={"fingerprint": "f" * 64}, code_version="c0de",
                            results={"dev": {}}, metrics={}, runs={}, arm=c.arm, seed=c.seed)

    monkeypatch.setitem(sys.modules, "ray", SerialRay())
    monkeypatch.setattr(dispatch, "cell_task", task)
    said = []
    with pytest.raises(SlmsqlError, match=r"^1 cell\(s\) failed on Ray: a-seed1 \(the others are recorded\)"):
        dispatch.on_ray(s, s.cells(), cells.Start("p", "b", {}), "w", "", lambda c, path, why="": said.append(
            (c.id, path, why)), reuse=reuse)
    assert got == [(c.id, reuse) for c in s.cells()]  # every task ran, each told the run's reuse
    assert said[1] == ("a-seed1", None, "failed: the worker's cell failed")
    assert sorted(records.read(s)[1]) == ["a-seed0", "b-seed0", "b-seed1"]


def test_a_retry_kills_its_previous_attempts_group_only_on_the_machine_and_boot_it_ran_on(tmp_path):
    """The group a dead worker left (its parent gone, as here: started by a process that exited)."""
    spawn = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
             "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
             "print(p.pid)")
    pgid = int(subprocess.run([sys.executable, "-c", spawn], capture_output=True, text=True, check=True).stdout)
    try:
        pgid_file = tmp_path / "attempt.pgid"
        pgid_file.write_text(json.dumps({"pgid": pgid, **leases.me(), "boot_id": "another boot"}))
        dispatch._kill_group(pgid_file)
        assert dispatch._alive(pgid)  # a pid from another boot names nothing here: left alone
        pgid_file.write_text(json.dumps({"pgid": pgid, **leases.me()}))
        dispatch._kill_group(pgid_file)  # returns once the group is gone (at most a zombie left to its reaper)
        assert not dispatch._alive(pgid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, 9)


def test_a_record_leaves_out_the_questions_evaluate_leaves_out():
    """Under test-suite a gold empty or failing on its whole suite is reported, never a wrong answer: a record
    holds the questions evaluate counts in n (the start of smollm2-spider once held all 1,034, its EX 7.0% against
    evaluate's 7.1% of 1,018). Under bird and spider a failing gold still scores wrong, as in their evaluators."""
    rows = [{"id": 1, "status": "correct", "correct": True, "predicted_sql": "SELECT 1"},
            {"id": 2, "status": "gold_empty", "correct": False, "predicted_sql": "SELECT 2"},
            {"id": 3, "status": "gold_error", "correct": False, "predicted_sql": "SELECT 3"},
            {"id": 4, "status": "wrong_result", "correct": False, "predicted_sql": "SELECT 4"}]
    assert sorted(records.results(rows, "test-suite")) == ["1", "4"]
    assert sorted(records.results(rows, "spider")) == ["1", "2", "3", "4"]
    assert records.results(rows, "test-suite")["1"] == [True, records.sql_hash("SELECT 1")]


def test_secondary_comparisons_are_read_and_one_in_the_family_is_refused(folder):
    path = folder / "study.yaml"
    text = path.read_text()
    path.write_text(text + "secondary:\n  - {arm: b}\n")
    s = spec.load(folder)
    assert s.secondary == [{"arm": "b", "against": "start", "eval_set": "dev"}]
    assert s.as_dict()["secondary"] == s.secondary and s.comparisons == [
        {"arm": "a", "against": "start", "eval_set": "dev"}, {"arm": "b", "against": "a", "eval_set": "dev"}]
    for none in ("secondary:\n", "secondary: null\n", "secondary: ~\n"):  # none declared: none (not every arm's)
        path.write_text(text + none)
        assert spec.load(folder).secondary == [] and "secondary" not in spec.load(folder).as_dict()
    path.write_text(text + "secondary:\n  - {arm: a}\n")  # a vs the start is the family's first comparison
    with pytest.raises(DataError, match="is in the Holm family") as e:
        spec.load(folder)
    assert (e.value.path, e.value.field) == (path, "secondary")
