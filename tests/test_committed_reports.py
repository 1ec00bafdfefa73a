"""Every committed study report is current with its records: `studies/*/report.json` and `report.md` are what
`slmsql study report` makes from the study's records today (issue 58). A report left behind by a change to the
statistics, the tables or the records fails here with the study named; regenerate it with
`slmsql study report studies/NAME` (then `python scripts/results_table.py` for the README's table)."""

from pathlib import Path

import pytest

from slmsql.stages import study as stage
from slmsql.studies import records, report, spec

ROOT = Path(__file__).resolve().parents[1]
STUDIES = sorted(p.parent.name for p in (ROOT / "studies").glob("*/study.yaml"))


def regenerate(folder: Path, into: Path) -> None:
    """The report of the study in `folder`, from its records alone, written into `into` (as `study report`
    builds it, but not over the committed files)."""
    s = spec.load(folder)
    report.write(into, stage.build_report(s, *records.read(s)))


def stale(folder: Path, into: Path) -> list[str]:
    """The report files of `folder` that differ from a regeneration into `into` (a missing one counts)."""
    regenerate(folder, into)
    return [name for name in ("report.json", "report.md")
            if not (folder / name).is_file() or (folder / name).read_bytes() != (into / name).read_bytes()]


def test_there_are_committed_studies():
    assert len(STUDIES) >= 4 and "smollm2-transfer" in STUDIES


@pytest.mark.parametrize("name", STUDIES)
def test_the_committed_report_is_its_records_report(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # a study's recipes are named from the repository's root
    differ = stale(ROOT / "studies" / name, tmp_path)
    assert not differ, (f"studies/{name}: {', '.join(differ)} not what its records give today; run `slmsql study "
                        f"report studies/{name}` and `python scripts/results_table.py`")


def test_a_stale_report_is_named(tmp_path, monkeypatch):
    """The check can fail: a copy of a study whose report.md lost a line is found stale, by file."""
    import shutil

    monkeypatch.chdir(ROOT)
    name = "toy-study"
    copy = tmp_path / "studies" / name
    shutil.copytree(ROOT / "studies" / name, copy)
    md = copy / "report.md"
    md.write_text(md.read_text(encoding="utf-8").replace("**Provenance.**", "**Provenance**"), encoding="utf-8")
    (tmp_path / "out").mkdir()
    assert stale(copy, tmp_path / "out") == ["report.md"]
