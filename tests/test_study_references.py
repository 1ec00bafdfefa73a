"""A study's references (studies/spec.py `references`): policies it evaluates beside the start on every eval set but
does not train (a base model zero-shot), each kept as records/ref-NAME.json, checked as a cell's record is, reported
with EX and its Wilson interval and beside the start with the exact paired interval and McNemar's exact p, unadjusted
and outside the Holm family, and shown in the README's generated table on the study's eval sets."""

import json

import pytest
from statsmodels.stats.proportion import proportion_confint
from test_study import YAML, RecordingSteps, fake_records, folder  # noqa: F401  (the fixture)

from slmsql.configs import StudyRunConfig
from slmsql.errors import DataError
from slmsql.stages import study as stage
from slmsql.studies import cells, readme, records, report, spec

REFS = "references:\n  zero-shot: {model: HuggingFaceTB/SmolLM2-135M-Instruct}\n"


@pytest.fixture
def with_refs(folder):  # noqa: F811
    path = folder / "study.yaml"
    path.write_text(path.read_text() + REFS)
    return folder


def ref_record(study, right: list[bool], code="c0de", fingerprint="f" * 64, **config) -> dict:
    return records.make(study, "ref-zero-shot", config={**study.reference_config("zero-shot"), **config},
                        start={"fingerprint": fingerprint}, code_version=code,
                        results={"dev": {f"q{i}": [r, "2" * 16] for i, r in enumerate(right)}}, metrics={}, runs={})


def test_a_reference_is_declared_by_name_and_model(with_refs):
    s = spec.load(with_refs)
    assert s.references == {"zero-shot": {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "adapter": ""}}
    cfg = s.reference_config("zero-shot")
    assert cfg["reference"] == "zero-shot" and cfg["eval_sets"] == ["dev"] and "model" not in cfg["evaluate"]
    assert [c.id for c in s.cells()] == ["a-seed0", "a-seed1", "b-seed0", "b-seed1"]  # not a cell


@pytest.mark.parametrize("refs, line, field, says", [
    ("references:\n  zero-shot: {adapter: x}\n", 19, "references.zero-shot", "give the reference's model"),
    ("references:\n  zero shot: {model: m}\n", 19, "references.zero shot", "letters, digits"),
    ("references:\n  z: {model: m, seed: 1}\n", 19, "references.z.seed", "unknown key"),
])
def test_a_bad_reference_is_refused_naming_file_line_and_key(folder, refs, line, field, says):  # noqa: F811
    path = folder / "study.yaml"
    path.write_text(path.read_text() + refs)
    with pytest.raises(DataError) as e:
        spec.load(folder)
    assert (e.value.path, e.value.line, e.value.field) == (path, line, field)
    assert says in str(e.value)


def test_a_reference_record_is_read_apart_from_the_cells_and_checked_as_they_are(with_refs):
    s = spec.load(with_refs)
    fake_records(s)
    records.write(s, ref_record(s, [True] * 6))
    start, done = records.read(s)
    assert sorted(done) == [c.id for c in s.cells()]
    assert list(records.references(s, start)) == ["zero-shot"]
    # another model than declared, another start, code the study does not accept: refused by file and field
    for kw, field in (({"model": "other/model"}, "config"), ({"fingerprint": "e" * 64}, "start"),
                      ({"code": "beef"}, "code_version")):
        records.path_of(s, "ref-zero-shot").unlink()
        records.write(s, ref_record(s, [True] * 6, **kw))
        with pytest.raises(DataError) as e:
            records.references(s, start)
        assert (e.value.path, e.value.field) == (records.path_of(s, "ref-zero-shot"), field)
    # a reference the declaration does not name is a record of nothing
    (s.records / "ref-other.json").write_text("{}")
    with pytest.raises(DataError, match="a record for no declared cell"):
        records.read(s)


def test_the_report_gives_a_references_ex_and_its_difference_from_the_start(with_refs):
    """Six questions: the start right on q0, q2, q4; the reference on q0..q4. EX 5/6 with Wilson's interval
    (statsmodels' own), difference +2/6 with discordant pairs (2 for the reference, 0 against): McNemar's exact p is
    the binomial 2 * 0.5^2 = 0.5."""
    s = spec.load(with_refs)
    fake_records(s)
    rep = report.build(s.as_dict(), *records.read(s)[:1], [], [ref_record(s, [True] * 5 + [False])])
    (ref,) = rep["references"]
    (x,) = ref["sets"]
    lo, hi = proportion_confint(5, 6, alpha=0.05, method="wilson")
    assert (x["n"], x["ex"], x["ex_start"]) == (6, pytest.approx(5 / 6), pytest.approx(3 / 6))
    assert (x["ex_ci_low"], x["ex_ci_high"]) == (pytest.approx(lo), pytest.approx(hi))
    assert x["diff"] == pytest.approx(2 / 6) and x["mcnemar_p"] == pytest.approx(0.5)
    assert x["diff_ci_low"] < 0 < x["diff_ci_high"]  # 2 discordant pairs decide nothing
    assert rep["references_missing"] == [] and rep["comparisons"] == 2  # not in the Holm family
    md = report.markdown(rep)
    assert "**References.**" in md and "| zero-shot | `HuggingFaceTB/SmolLM2-135M-Instruct` | dev | 6 | 83.3%" in md
    none = report.build(s.as_dict(), records.read(s)[0], [], [])
    assert none["references"] == [] and none["references_missing"] == ["ref-zero-shot"]
    assert "- `ref-zero-shot` (records/ref-zero-shot.json)" in report.markdown(none)


def test_a_reference_that_scored_other_questions_is_refused(with_refs):
    s = spec.load(with_refs)
    fake_records(s)
    with pytest.raises(DataError, match="scored other questions than the start on 'dev'"):
        report.build(s.as_dict(), records.read(s)[0], [], [ref_record(s, [True] * 5)])


def test_the_readme_rows_show_a_reference_beside_the_studys_comparisons(with_refs):
    s = spec.load(with_refs)
    fake_records(s)
    start, done = records.read(s)
    rep = report.build(s.as_dict(), start, list(done.values()), [ref_record(s, [True] * 5 + [False])])
    rows = readme.rows("demo", json.loads(json.dumps(rep)))
    assert len(rows) == 3 and rows[2].startswith(
        "| `studies/demo`: same study (reference zero-shot: `HuggingFaceTB/SmolLM2-135M-Instruct`, not trained) | "
        "dev (6) | start 50.0%; reference 83.3% | +33.3 [")
    assert rows[2].endswith("| McNemar 0.50, unadjusted | a reference: outside the family, no verdict |")


def test_study_run_evaluates_a_reference_and_writes_its_record_once(with_refs, tmp_path, monkeypatch):
    """The wiring of `study run` for a reference (no model: FakeSteps' evaluations say q0 and q1 right): evaluate
    on every eval set with the reference's model and no adapter, one record; --cells names it as ref-NAME."""
    from slmsql.workflow.steps import code_version

    s = spec.load(with_refs)
    fake_records(s, code=code_version())
    fake = RecordingSteps(tmp_path / "work")
    ran = fake.ran
    monkeypatch.setattr(cells, "steps", lambda *a, **k: fake)
    band = tmp_path / "band.jsonl"
    band.write_text("")
    monkeypatch.setattr(cells, "start", lambda study, steps, known: cells.Start(str(tmp_path / "model"), str(band),
                                                                               known))  # the recorded start
    out = stage.run(StudyRunConfig(study=str(with_refs), cells=["ref-zero-shot"], report=False))
    assert out["ran"] == []
    ((name, params),) = ran
    assert name == "evaluate" and params["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and "adapter" not in params
    rec = json.loads(records.path_of(s, "ref-zero-shot").read_text())
    assert rec["results"]["dev"]["q0"][0] is True and rec["results"]["dev"]["q5"][0] is False
    assert rec["config"] == s.reference_config("zero-shot") and rec["arm"] is None
    ran.clear()
    stage.run(StudyRunConfig(study=str(with_refs), cells=["ref-zero-shot"], report=False))
    assert ran == []  # recorded: not evaluated again
    with pytest.raises(DataError, match=r"references: \['ref-zero-shot'\]"):
        stage.run(StudyRunConfig(study=str(with_refs), cells=["ref-zeroshot"], report=False))


def test_references_go_to_the_first_share_only_and_to_cells_that_name_them(with_refs):
    """A reference is minutes beside a cell: under --shard K/N the first share evaluates them all, the others none;
    --cells takes only those it names (ref-NAME); a recorded one is never taken again."""
    s = spec.load(with_refs)

    def todo(done=None, **kw):
        return stage.references_todo(s, done or {}, StudyRunConfig(study=str(with_refs), **kw))

    assert todo() == ["zero-shot"]
    assert (todo(shard="1/2"), todo(shard="2/2"), todo(shard="1/1")) == (["zero-shot"], [], ["zero-shot"])
    assert (todo(cells=["ref-zero-shot"]), todo(cells=["a-seed0"])) == (["zero-shot"], [])
    assert todo({"zero-shot": {}}) == todo({"zero-shot": {}}, shard="1/2") == []
