from pathlib import Path

from click.testing import CliRunner

from slmsql.cli import main

EXAMPLES = Path(__file__).parents[1] / "examples"


def test_unreachable_tracking_server_fails_fast_with_no_output(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens on the discard port
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["evaluate", "--data", str(EXAMPLES / "gold.jsonl"), "--db-root",
                                       str(EXAMPLES / "databases"), "--predictions",
                                       str(EXAMPLES / "predictions.jsonl"), "--output-dir", str(out)])
    assert result.exit_code == 2
    assert "tracking server http://127.0.0.1:9 is unreachable" in result.output
    assert not out.exists() and not out.with_name("out.partial").exists()


def test_example_predictions_score_with_every_status(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["evaluate", "--data", str(EXAMPLES / "gold.jsonl"), "--db-root",
                                       str(EXAMPLES / "databases"), "--predictions",
                                       str(EXAMPLES / "predictions.jsonl"), "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    import json

    rows = {r["id"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert rows["q1"]["correct"] and rows["q2"]["correct"]          # bare SQL and a ```sql block
    assert rows["q5"]["status"] == "error" and "categry" in rows["q5"]["error"]
    assert rows["q6"]["status"] == "no_sql"
    assert rows["q7"]["status"] == "rejected"                       # DROP TABLE never runs
    assert rows["q8"]["status"] in ("truncated", "timeout")          # unbounded recursive CTE
    assert rows["q10"]["status"] == "missing"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n"] == 10 and metrics["ex"] == sum(r["correct"] for r in rows.values()) / 10
