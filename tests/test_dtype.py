"""--dtype: auto is float32 on a CPU (bfloat16 on a GPU that has it), the resolved choice is the run's
slmsql.dtype tag, the training stages train in it, and float16 on a CPU is refused before any model loads."""

from __future__ import annotations

import mlflow
import pytest
import torch
from click.testing import CliRunner

from slmsql.policy import models
from slmsql.training import hf_trainer as training
from slmsql.cli import main as cli
from slmsql.errors import SlmsqlError
from slmsql.toy.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("dtype") / "m", ["SELECT name FROM item"] * 8, vocab_size=300,
                            hidden=16, layers=1, heads=2, ffn=32)


def test_auto_is_float32_on_cpu_and_the_trainer_flags_follow():
    assert models.dtype_name("auto", "cpu") == "float32"
    assert models.dtype_name("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(SlmsqlError, match="float16 needs a GPU"):
        models.dtype_name("float16", "cpu")
    if not torch.cuda.is_available():
        assert training.device_args("auto") == {"use_cpu": True, "bf16": False, "fp16": False}
        assert training.device_args("bfloat16")["bf16"] is True


def test_load_model_tags_the_resolved_dtype(tiny):
    mlflow.set_experiment("dtype")  # the process-wide experiment an earlier test's stage set is in another store
    with mlflow.start_run() as run:
        lm, _ = models.load_model(tiny, device="cpu")
    assert lm.dtype == torch.float32
    assert mlflow.get_run(run.info.run_id).data.tags["slmsql.dtype"] == "float32"


def test_training_in_float16_on_cpu_is_refused_before_the_model_loads(tiny, tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("float16 is allowed on a GPU")

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_model", no_load)
    (tmp_path / "sft.jsonl").write_text('{"id": "1", "db_id": "d", "question": "q", "sql": "SELECT 1"}\n')
    (tmp_path / "db" / "d").mkdir(parents=True)
    import sqlite3

    sqlite3.connect(tmp_path / "db" / "d" / "d.sqlite").execute("CREATE TABLE t (a INTEGER)")
    result = CliRunner().invoke(cli, ["sft", "--model", str(tiny), "--data", str(tmp_path / "sft.jsonl"),
                                      "--db-root", str(tmp_path / "db"), "--dtype", "float16",
                                      "--output-dir", str(tmp_path / "out")])
    assert result.exit_code != 0
    assert "float16 needs a GPU" in result.output + str(result.exception)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
