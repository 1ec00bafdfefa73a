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
        assert {"ex", "ex_ci_low", "ex_ci_high", "vs_baseline/p", "vs_baseline/diff"} <= set(r.data.metrics)
        assert r.data.tags["slmsql.verdict"] in ("improved", "regressed", "no significant difference")
        assert r.data.tags["slmsql.baseline_run"] == children[name.replace("grpo", "sft")].info.run_id
        assert {"results.jsonl", "metrics.json", "predictions.jsonl", "ex_intervals.png"} <= arts(r)


def _runs(uri):
    import mlflow

    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("slmsql")
    runs = client.search_runs([exp.experiment_id])
    [parent] = [r for r in runs if r.data.tags.get("slmsql.stage") == "pipeline"]
    return client, exp, parent, {r.info.run_name: r for r in runs if r is not parent}


def test_every_run_describes_its_result_in_documented_names(lifecycle):
    from slmsql import tracking

    uri, root, run = lifecycle
    assert run.returncode == 0, run.stderr[-4000:]
    client, exp, parent, children = _runs(uri)
    assert "Metric vocabulary" in exp.tags[tracking.NOTE]
    for r in [parent, *children.values()]:
        stage = r.data.tags["slmsql.stage"]
        assert r.data.tags.get(tracking.NOTE), f"{r.info.run_name} has no description"
        assert not [k for k in r.data.metrics if not tracking.documented(k, stage)], r.info.run_name
    # the parent: the headline as metrics (named <step>/<metric>), verdicts as tags, both in its description
    m, tags, note = parent.data.metrics, parent.data.tags, parent.data.tags[tracking.NOTE]
    for split in ("dev", "dev_cross"):
        grpo_eval, sft_eval = children[f"eval-grpo-{split}"], children[f"eval-sft-{split}"]
        assert m[f"eval-grpo-{split}/ex"] == grpo_eval.data.metrics["ex"]
        assert m[f"eval-sft-{split}/ex"] == sft_eval.data.metrics["ex"] == grpo_eval.data.metrics["baseline/ex"]
        assert m[f"eval-grpo-{split}/vs_baseline/p"] == grpo_eval.data.metrics["vs_baseline/p"]
        assert tags[f"slmsql.verdict.{split}"] == grpo_eval.data.tags["slmsql.verdict"]
        assert (f"{split}: SFT {100 * sft_eval.data.metrics['ex']:.1f}% → GRPO {100 * m[f'eval-grpo-{split}/ex']:.1f}%,"
                in note)
        assert f"): {tags[f'slmsql.verdict.{split}']}." in note
        assert sft_eval.data.tags[tracking.NOTE].startswith(f"EX {100 * sft_eval.data.metrics['ex']:.1f}%")
        assert f"vs eval-sft-{split}: " in grpo_eval.data.tags[tracking.NOTE]
    assert m["filter/band"] == children["filter"].data.metrics["band"]
    assert f"Filter: {m['filter/band']:.0f} band questions of {m['filter/n_source']:.0f}" in note


def test_lineage_run_uris_and_dataset_inputs(lifecycle):
    uri, root, run = lifecycle
    assert run.returncode == 0, run.stderr[-4000:]
    client, _, parent, c = _runs(uri)
    for r in c.values():  # what a step took from another run is that run's URI, not this machine's copy
        assert not [v for v in r.data.params.values() if "from-runs" in v], r.info.run_name
        assert "" not in r.data.params.values()
    sft, filt, grpo = c["sft"].info.run_id, c["filter"].info.run_id, c["grpo"].info.run_id
    assert c["grpo"].data.params["model"] == f"runs:/{sft}/policy"
    assert c["grpo"].data.params["data"] == f"runs:/{filt}/band.jsonl"
    assert c["eval-grpo-dev"].data.params["adapter"] == f"runs:/{grpo}/adapter"
    inputs = {name: {(i.dataset.name, i.dataset.digest) for i in c[name].inputs.dataset_inputs}
              for name in ("filter", "grpo", "eval-sft-dev", "eval-grpo-dev")}
    assert inputs["filter"] == inputs["grpo"] and {n for n, _ in inputs["grpo"]} == {"rl"}  # one name, one digest
    assert inputs["eval-sft-dev"] == inputs["eval-grpo-dev"] and {n for n, _ in inputs["eval-sft-dev"]} == {"toy-dev"}


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
