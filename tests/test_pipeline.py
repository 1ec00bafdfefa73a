"""The whole toy lifecycle against a real `mlflow server` on loopback, checked through MlflowClient.

Shortened (fewer SFT/GRPO steps) so CI stays quick; everything else is the embedded default, for real.
"""

import subprocess
import sys

import pytest

from slmsql.tracking import start_server

pytestmark = pytest.mark.slow
SHORT = ("sft.max_steps=400 grpo.max_steps=3 grpo.save_steps=2 grpo.completions_every=1 "
         "grpo.num_generations=4 grpo.per_device_train_batch_size=8")


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory):
    root = tmp_path_factory.mktemp("lifecycle")
    log = open(root / "server.log", "wb")
    proc, uri = start_server(port=0, store=root / "store.db", artifacts=root / "artifacts",
                             log_file=log)
    try:
        env = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_DISABLE_TELEMETRY": "true", "PATH": _path()}
        run = subprocess.run([sys.executable, "-m", "slmsql.cli", "pipeline", "--output-dir",
                              str(root / "out"), "--overrides", SHORT], cwd=root, env=env,
                             capture_output=True, text=True, timeout=1500)
        yield uri, root, run
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _path():
    import os

    return f"{sys.prefix}/bin:{os.environ['PATH']}"


def test_lifecycle_runs_and_prints_headline(lifecycle):
    uri, root, run = lifecycle
    assert run.returncode == 0, run.stderr[-4000:]
    assert "slmsql lifecycle (embedded toy default) finished" in run.stdout
    assert "EX dev" in run.stdout and "model card" in run.stdout


def test_every_step_is_a_child_run_with_its_metrics_and_artifacts(lifecycle, monkeypatch):
    uri, root, run = lifecycle
    assert run.returncode == 0, run.stderr[-4000:]
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name("slmsql")
    runs = client.search_runs([exp.experiment_id])
    [parent] = [r for r in runs if r.data.tags.get("slmsql.stage") == "pipeline"]
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert set(children) == {"toy", "tiny-model", "sft", "filter", "grpo", "eval-sft-dev", "eval-grpo-dev",
                             "eval-sft-dev_cross", "eval-grpo-dev_cross", "publish"}
    assert all(r.info.status == "FINISHED" for r in children.values())

    arts = lambda r, path="": {f.path for f in client.list_artifacts(r.info.run_id, path)}  # noqa: E731
    assert {"band", "all_fail", "all_pass", "out_of_band", "errors"} <= set(children["filter"].data.metrics)
    assert {"band.jsonl", "summary.json", "pass_rate_histogram.png"} <= arts(children["filter"])
    grpo = children["grpo"].data.metrics
    for key in ("reward", "reward_std", "frac_reward_zero_std", "grad_norm", "rewards/execution/mean",
                "exec/frac_groups_correctness_varies", "summary/frac_reward_zero_std"):
        assert key in grpo, key
    assert "adapter/adapter_config.json" in arts(children["grpo"], "adapter")
    assert any(p.startswith("completions/step_") for p in arts(children["grpo"], "completions"))
    for name in ("eval-grpo-dev", "eval-grpo-dev_cross"):
        r = children[name]
        assert {"ex", "ex_ci_low", "ex_ci_high", "vs_baseline_mcnemar_p", "vs_baseline_diff"} <= set(r.data.metrics)
        assert r.data.tags["slmsql.verdict"] in ("improved", "regressed", "no significant difference")
        assert r.data.tags["slmsql.baseline_run"] == children[name.replace("grpo", "sft")].info.run_id
        assert {"results.jsonl", "metrics.json", "predictions.jsonl", "ex_intervals.png"} <= arts(r)


def test_card_states_the_measured_numbers(lifecycle):
    uri, root, run = lifecycle
    assert run.returncode == 0, run.stderr[-4000:]
    import mlflow

    client = mlflow.MlflowClient(uri)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])}
    card = (root / "out" / "publish" / "README.md").read_text()
    assert card.startswith("---\n") and "model-index" in card
    band = int(runs["filter"].data.metrics["band"])
    assert f"| band | 0.2 < p < 0.8 | {band} |" in card
    assert "| all fail | 0/8 |" in card and "| all pass | 8/8 |" in card
    ex = runs["eval-grpo-dev"].data.metrics["ex"]
    assert f"{100 * ex:.1f}%" in card


def test_rerun_reuses_finished_steps(lifecycle):
    uri, root, run = lifecycle
    assert run.returncode == 0, run.stderr[-4000:]
    env = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_DISABLE_TELEMETRY": "true", "PATH": _path()}
    again = subprocess.run([sys.executable, "-m", "slmsql.cli", "pipeline", "--output-dir", str(root / "out"),
                            "--overrides", SHORT], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stderr.count("reused run") == 10
