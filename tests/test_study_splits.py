"""What issue 59's study needs of studies: a benchmark split by database (`db_ids` on the filter and on an eval set,
made by scripts/split_databases.py with a seed), a start that is the model itself zero-shot (no SFT, no adapter:
its weights fingerprinted, its band alone pinned), and an arm that trains on an unfiltered sample of the filter's
source the band's size (`train_on: sample`). Without training: `workflow.Steps` is test_study's FakeSteps."""

import json
import os
import random
import sys
from pathlib import Path

import pytest
import watched
from test_study import YAML, RecordingSteps, fake_records

from slmsql.errors import DataError
from slmsql.inputs.data import questions
from slmsql.studies import cells, records, spec

ROOT = Path(__file__).resolve().parents[1]
DBS = ["alpha", "beta", "gamma", "delta", "eps"]


@pytest.fixture
def gold(tmp_path):
    """20 questions, 4 on each of 5 databases, interleaved: q<i> on DBS[i % 5]."""
    path = tmp_path / "gold.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "db_id": DBS[i % 5], "question": f"how many {i}?",
                                        "sql": f"SELECT {i}"}) + "\n" for i in range(20)))
    return path


def test_db_ids_keep_a_files_questions_on_those_databases_with_their_ids_then_the_limit(gold):
    got = questions(gold, ["beta", "eps"])
    assert [e.id for e in got] == ["q1", "q4", "q6", "q9", "q11", "q14", "q16", "q19"]
    assert [e.id for e in questions(gold, ["beta", "eps"], limit=3)] == ["q1", "q4", "q6"]
    assert len(questions(gold)) == 20
    with pytest.raises(DataError, match=r"on database\(s\) \['zeta'\]") as e:
        questions(gold, ["beta", "zeta"])
    assert e.value.field == "db_ids"


@pytest.mark.slow
def test_evaluate_scores_only_the_questions_on_the_named_databases_from_the_command_line(tmp_path, shop):
    data = tmp_path / "two.jsonl"
    data.write_text('{"id": "a", "db_id": "shop", "question": "n?", "sql": "SELECT count(*) FROM item"}\n'
                    '{"id": "b", "db_id": "elsewhere", "question": "m?", "sql": "SELECT 1"}\n')
    preds = tmp_path / "preds.jsonl"
    preds.write_text('{"id": "a", "sql": "SELECT count(*) FROM item"}\n')  # none for b: it is not asked
    out = tmp_path / "eval"
    r = watched.run([sys.executable, "-m", "slmsql.cli", "evaluate", "--predictions", str(preds), "--data", str(data),
                     "--db-root", str(shop), "--db-ids", "shop", "--output-dir", str(out)], cwd=tmp_path,
                    env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert [json.loads(x)["id"] for x in (out / "results.jsonl").read_text().splitlines()] == ["a"]
    bad = watched.run([sys.executable, "-m", "slmsql.cli", "evaluate", "--predictions", str(preds), "--data",
                       str(data), "--db-root", str(shop), "--db-ids", "shop,nowhere", "--output-dir",
                       str(tmp_path / "bad")], cwd=tmp_path,
                      env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    assert bad.returncode != 0 and "db_ids" in bad.stderr and "nowhere" in bad.stderr
    assert not (tmp_path / "bad").exists()


def split(data, seed) -> dict:
    r = watched.run([sys.executable, str(ROOT / "scripts" / "split_databases.py"), str(data), "--seed", str(seed)])
    assert r.returncode == 0, r.stderr
    return {k: v.strip(" []").split(", ") for k, v in (line.split(": ", 1) for line in r.stdout.splitlines()
                                                          if not line.startswith("#"))}


def test_the_split_halves_the_databases_by_a_seed_from_the_command_line(gold):
    one = split(gold, 0)
    assert sorted(one["train"] + one["held_out"]) == sorted(DBS) and len(one["train"]) == 2
    assert split(gold, 0) == one  # same seed, same lists
    assert any(split(gold, s) != one for s in (1, 2, 3))  # the seed decides
    # what the script computes, independently: sorted names shuffled by random.Random(seed), the first half trains
    dbs = sorted(DBS)
    random.Random(0).shuffle(dbs)
    assert one["train"] == sorted(dbs[:2])
    r = watched.run([sys.executable, str(ROOT / "scripts" / "split_databases.py"), str(gold.parent / "none.json"),
                     "--seed", "0"])
    assert r.returncode == 2 and "none.json: no such file" in r.stderr and not r.stdout


def spider_dev() -> Path:
    found = os.environ.get("SLMSQL_SPIDER_DIR")
    if not found:
        if os.environ.get("CI"):
            pytest.fail("SLMSQL_SPIDER_DIR is missing; under CI this test must run (.ci/run sets it)")
        pytest.skip("SLMSQL_SPIDER_DIR: Spider's dev.json is not here (make spider)")
    return Path(found) / "dev.json"


def test_the_pilots_split_is_the_scripts_output_for_seed_0(monkeypatch):
    monkeypatch.chdir(ROOT)
    s = spec.load(ROOT / "studies" / "qwen05-spider-pilot")
    want = split(spider_dev(), 0)
    assert sorted(s.band["db_ids"]) == want["train"]
    assert list(s.eval_sets[0].db_ids) == want["held_out"] and s.eval_sets[1].data == spec.BAND
    assert s.zero_shot and s.pin
    full = spec.load(ROOT / "studies" / "qwen05-spider")  # issue 59's study: the pilot's start, the same held-out set
    assert spec.spec_of_start(full).folder.resolve() == s.folder.resolve()
    assert [(es.data, es.db_ids) for es in full.eval_sets] == [(es.data, es.db_ids) for es in s.eval_sets]
    assert full.train_on == {"unfiltered": "sample"} and full.grpo_config("band") == s.grpo_config("band")


ZERO_SHOT = YAML.replace("  adapter: {model}\n", "  pin: true\n")


@pytest.fixture
def zero(tmp_path, shop, gold):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    f = tmp_path / "studies" / "zero"
    f.mkdir(parents=True)
    (f / "study.yaml").write_text(ZERO_SHOT.format(model=model, db=shop, dev=gold).replace(
        "band: {limit: 10,", "band: {db_ids: [alpha, beta, gamma],").replace(
        "  b: {learning_rate: 3.0e-4}\n", "  b: {train_on: sample}\n"))
    return f


class FilterSteps(RecordingSteps):
    """RecordingSteps whose filter step leaves a band of the questions `band` names."""

    def __init__(self, out, band):
        super().__init__(out)
        self.band = band

    def artifact(self, run, path):
        if path != "band.jsonl":
            return super().artifact(run, path)
        out = self.out / "band.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps({"id": q, "db_id": "alpha", "question": q, "sql": "SELECT 1"}) + "\n"
                               for q in self.band))
        return str(out)


def test_a_zero_shot_start_is_the_model_its_weights_fingerprinted_and_its_band_alone_pinned(zero, tmp_path):
    s = spec.load(zero)
    assert s.zero_shot and s.sft is None and s.adapter == ""
    steps = FilterSteps(tmp_path / "work", ["q0", "q5", "q1"])
    st = cells.start(s, steps, None)
    model = str(tmp_path / "model")
    (stage, params), = [r for r in steps.ran if r[0] == "filter"]
    assert params["model"] == model and "adapter" not in params  # the filter samples the model itself
    assert params["db_ids"] == "alpha,beta,gamma"
    assert sorted(p.name for p in s.pinned.iterdir()) == ["band.jsonl"]  # no copy of the model
    assert st.policy == model and st.record["start"] == records.fingerprint(model, s.pinned / "band.jsonl")
    # found pinned the next time, and the same; other weights under the same path are another start
    assert cells.start(s, FilterSteps(tmp_path / "w2", []), st.record).record == st.record
    (tmp_path / "model" / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(DataError, match="is not the one the study's records come from"):
        cells.start(s, FilterSteps(tmp_path / "w3", []), st.record)


def test_a_start_model_by_hub_id_missing_from_the_cache_is_refused_by_name(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    band = tmp_path / "band.jsonl"
    band.write_text("{}\n")
    with pytest.raises(DataError, match="neither a folder nor in this machine's Hugging Face cache") as e:
        cells.fingerprint("nobody/no-such-model", str(band), tmp_path / "study.yaml")
    assert (e.value.path, e.value.field) == (tmp_path / "study.yaml", "start.model")


def test_an_unfiltered_arm_trains_on_the_bands_size_drawn_from_the_filters_source(zero, tmp_path, gold):
    s = spec.load(zero)
    steps = FilterSteps(tmp_path / "work", ["q0", "q5", "q1"])
    st = cells.start(s, steps, None)
    data = {}
    for c in s.cells():
        steps.ran.clear()
        rec = cells.cell(s, steps, c, st)
        (params,) = [p for stage, p in steps.ran if stage == "grpo"]
        data[c.id] = Path(params["data"])
        assert rec["config"] == s.cell_config(c)
    assert data["a-seed0"] == data["a-seed1"] == Path(st.band)  # the band arm trains on the band
    drawn = [json.loads(x) for x in data["b-seed0"].read_text().splitlines()]
    assert data["b-seed0"].read_text() == data["b-seed1"].read_text()  # one sample for every seed, as the band is
    source = [e for e in questions(gold) if e.db_id in ("alpha", "beta", "gamma")]  # the filter's db_ids, 12
    assert len(drawn) == 3 and {r["db_id"] for r in drawn} <= {"alpha", "beta", "gamma"}
    assert [r["id"] for r in drawn] == [e.id for e in source if e.id in {r["id"] for r in drawn}]  # source order
    chosen = sorted(random.Random(cells.SAMPLE_SEED).sample(range(len(source)), 3))
    assert [r["id"] for r in drawn] == [source[i].id for i in chosen]
    assert s.cell_config(s.cells()[-1])["train_on"] == "sample" and "train_on" not in s.cell_config(s.cells()[0])
    assert spec.load(zero).as_dict()["train_on"] == {"b": "sample"}


@pytest.mark.parametrize("edit, field, says", [
    (("  pin: true\n", "  pin: true\n  sft: {max_steps: 2}\n  adapter: x\n"), "start", "not both sft and adapter"),
    (("b: {train_on: sample}", "b: {train_on: all}"), "arms.b.train_on", "one of ['band', 'sample']"),
    (("name: dev, data:", "name: dev, db_ids: [alpha, alpha], data:"), "eval_sets.0.db_ids", "distinct"),
    (("eval_sets:\n", "eval_sets:\n  - {name: seen, data: band, db_ids: [alpha]}\n"), "eval_sets.0.db_ids",
     "the band is the start's own questions: no db_ids"),
])
def test_a_bad_split_start_or_arm_is_refused_naming_the_key(zero, edit, field, says):
    path = zero / "study.yaml"
    path.write_text(path.read_text().replace(*edit))
    with pytest.raises(DataError) as e:
        spec.load(zero)
    assert e.value.path == path and e.value.field == field and says in str(e.value)


def test_a_split_changed_after_the_records_is_refused_by_name(zero):
    s = spec.load(zero)
    fake_records(s)
    path = zero / "study.yaml"
    path.write_text(path.read_text().replace("name: dev, data:", "name: dev, db_ids: [alpha], data:"))
    with pytest.raises(DataError, match=r"differs from the declaration .*: eval_sets\.dev\.db_ids\. "):
        records.read(spec.load(zero))


def hub_cache(root: Path, repo: str, weights: bytes) -> Path:
    """A Hugging Face cache holding `repo` (refs/main -> one snapshot with a weights file), as `make qwen-coder`
    lays one out; returns the snapshot folder."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snap = repo_dir / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "model.safetensors").write_bytes(weights)
    (snap / "config.json").write_text("{}")
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text("a" * 40)
    return snap


def test_a_zero_shot_start_by_hub_id_is_fingerprinted_from_the_cache_here_and_on_a_worker(zero, tmp_path,
                                                                                          monkeypatch):
    """The driver and a Ray worker (`dispatch.main`) fingerprint the weights the cache holds for the Hub id."""
    from slmsql.studies import dispatch

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))  # read when a download is asked for
    snap = hub_cache(tmp_path / "cache", "org/tiny", b"cached weights")
    path = zero / "study.yaml"
    path.write_text(path.read_text().replace(f"model: {tmp_path / 'model'}", "model: org/tiny"))
    s = spec.load(zero)
    st = cells.start(s, FilterSteps(tmp_path / "work", ["q0", "q5"]), None)
    assert st.policy == "org/tiny"
    assert st.record["start"] == records.fingerprint(snap, s.pinned / "band.jsonl")
    monkeypatch.setattr(cells, "steps", lambda *a, **k: None)
    monkeypatch.setattr(cells, "cell", lambda study, steps, c, start: {"cell": c.id, "policy": start.policy})
    out = tmp_path / "rec.json"
    dispatch.main([str(zero), "a-seed0", "org/tiny", st.band, str(tmp_path / "w"), str(out), "true"])
    assert json.loads(out.read_text()) == {"cell": "a-seed0", "policy": "org/tiny"}
    (snap / "model.safetensors").write_bytes(b"other weights")  # another model under the same id: refused
    with pytest.raises(Exception, match="not the one .* start record names"):
        dispatch.main([str(zero), "a-seed1", "org/tiny", st.band, str(tmp_path / "w"), str(out), "true"])


def test_a_study_on_another_studys_zero_shot_start_trains_its_unfiltered_arm_from_that_filters_source(
        zero, tmp_path, gold):
    """Issue 59's shape: the pilot makes and pins a zero-shot start; the study takes it (start.from) and its
    unfiltered arm draws from the pilot's filter source (its db_ids), as many as the pilot's band holds."""
    pilot = spec.load(zero)
    rec = cells.start(pilot, FilterSteps(tmp_path / "work", ["q0", "q5", "q1", "q2"]), None)
    main = zero.parent / "main"
    main.mkdir()
    (main / "study.yaml").write_text(
        f"question: q\nstart: {{from: {zero}}}\ndb_root: {pilot.db_root}\narms:\n  u: {{train_on: sample}}\n"
        f"seeds: [0]\neval_sets:\n  - {{name: dev, data: {gold}, db_ids: [delta, eps]}}\n")
    s = spec.load(main)
    assert s.model == pilot.model and not s.zero_shot and spec.spec_of_start(s).zero_shot
    steps = RecordingSteps(tmp_path / "main-work")
    st = cells.start(s, steps, None)
    assert st.policy == pilot.model and st.record["start"] == rec.record["start"]  # the pilot's start, unmade
    assert [stage for stage, _ in steps.ran] == ["evaluate"]  # no filter again: only its own eval set
    assert steps.ran[0][1]["db_ids"] == "delta,eps" and steps.ran[0][1]["model"] == pilot.model
    steps.ran.clear()
    cells.cell(s, steps, s.cells()[0], st)
    data = Path(next(p for stage, p in steps.ran if stage == "grpo")["data"])
    drawn = [json.loads(x) for x in data.read_text().splitlines()]
    assert len(drawn) == 4 and {r["db_id"] for r in drawn} <= {"alpha", "beta", "gamma"}
