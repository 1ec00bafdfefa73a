"""The whole toy lifecycle against a real `mlflow server` on loopback, checked through MlflowClient, publishing
for real (--push) to the loopback Hub stand-in (tests/hubstub.py): the SFT model and the GRPO adapter.

Shortened (fewer GRPO steps) so CI stays quick; everything else is the embedded default, for real. SFT is the
demo's own (800 steps), not shortened: at 400 steps the toy SFT stops where its loss still falls steeply and EX
has not arrived (2.5% on toy-dev on an AVX2-only AMD machine, a filter band of 1 question in 300), and where on
that slope a float path lands decides whether GRPO has anything to train on (docs/toy.md, "Float paths").
"""

import json
import os
import sys
from pathlib import Path

import pytest
from hubstub import HubStub
import watched

from slmsql.tracking import runs as tracking
from slmsql.tracking.runs import start_server

SHORT = ("grpo.max_steps=3 grpo.save_steps=2 grpo.completions_every=1 "
         "grpo.num_generations=4 grpo.per_device_train_batch_size=8")
REPO, BASE_REPO = "slmsql/toy-grpo", "slmsql/toy-sft"  # the pipeline's defaults


@pytest.mark.slow
def test_overrides_reach_their_stage_only_after_its_own_parameters(tmp_path):
    """The fast part of this module: SHORT, as `slmsql pipeline --overrides` parses it, lands on every step of
    the stage it names (over the step's own value) and on no other stage."""
    from slmsql import configs
    from slmsql.workflow import steps as workflow

    cfg = configs.load(configs.PipelineConfig, None, {"overrides": "sft.max_steps=400 " + SHORT})
    assert cfg.overrides["sft.max_steps"] == 400 and cfg.overrides["grpo.num_generations"] == 4
    steps = workflow.Steps.__new__(workflow.Steps)  # params() alone: no store needed
    steps.out, steps.experiment, steps.seed, steps.overrides, steps.recipes = tmp_path, "e", 3, cfg.overrides, {}
    sft = steps.params("sft", "sft", {"max_steps": 800, "data": "runs:/x/sft.jsonl"})
    assert (sft["max_steps"], sft["data"], sft["seed"]) == (400, "runs:/x/sft.jsonl", 3)
    grpo = steps.params("grpo", "grpo", {})
    assert {k: grpo[k] for k in ("max_steps", "save_steps", "num_generations")} == {
        "max_steps": 3, "save_steps": 2, "num_generations": 4}
    assert "max_steps" not in steps.params("evaluate", "eval-sft-dev", {})


@pytest.mark.parametrize("store", ["sqlite:///mlflow.db", "http://127.0.0.1:5123"])
def test_headline_says_how_to_reach_the_ui_of_the_store_it_tracked_to(store, capsys, monkeypatch):
    """A local store: the `mlflow ui` command for that store, then the link; a tracking server: only the link
    (its UI is already up; starting `mlflow ui` on a local file would show another store)."""
    import mlflow

    from slmsql.stages.pipeline import print_headline

    mlflow.set_tracking_uri(store)
    link = tracking.ui_link("7", store)
    print_headline({}, {"dev": "no significant difference", "dev_cross": "improved"}, Path("card.md"), link, "m")
    out = capsys.readouterr().out
    assert link in out and "EX dev_cross : SFT n/a -> GRPO n/a" in out
    assert (f"mlflow ui --backend-store-uri {store}" in out) == store.startswith("sqlite:")
    assert ("--backend-store-uri" in out) != store.startswith("http")


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory):
    root = tmp_path_factory.mktemp("lifecycle")
    log = open(root / "server.log", "wb")
    proc, uri = start_server(port=0, store=root / "store.db", artifacts=root / "artifacts",
                             log_file=log, timeout_s=watched.STALL_S)
    try:
        with HubStub() as hub:
            run = pipeline(uri, root, hub)
            yield uri, root, run, hub
    finally:
        proc.terminate()
        proc.wait(timeout=watched.STALL_S)
        log.close()


def pipeline(uri, root, hub):
    """`slmsql pipeline --push` in a fresh process, which reaches the stand-in only through --hub-endpoint and
    gets the token only from HF_TOKEN (as hubstub.configure_client does in-process, by environment)."""
    env = {**_machine(), "MLFLOW_TRACKING_URI": uri, "MLFLOW_DISABLE_TELEMETRY": "true", "PATH": _path(),
           "HF_TOKEN": hub.token, "HF_HOME": str(root / "hf-home"), "HF_HUB_DISABLE_XET": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return watched.run([sys.executable, "-m", "slmsql.cli", "pipeline", "--output-dir", str(root / "out"),
                        "--overrides", SHORT, "--push", "--hub-endpoint", hub.url], cwd=root, env=env)


def _path():
    return f"{sys.prefix}/bin:{os.environ['PATH']}"


# What the suite was started with for threads and float paths, carried into the pipeline's clean environment:
# without OMP_NUM_THREADS its steps run torch on every core beside the other xdist worker (an 800-step SFT took
# 1234 s there, against 0.6 s a step alone), and without the MKL/oneDNN/ATen settings `make test-float` would not
# reach the lifecycle at all.
MACHINE = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
           "ATEN_CPU_CAPABILITY")


def _machine() -> dict:
    return {k: os.environ[k] for k in MACHINE if k in os.environ}


@pytest.mark.slow
def test_lifecycle_runs_and_prints_headline(lifecycle):
    uri, root, run, hub = lifecycle
    assert run.returncode == 0, run.stderr[-4000:]
    assert "slmsql lifecycle (embedded toy default) finished" in run.stdout
    assert "EX dev" in run.stdout and "model card" in run.stdout


@pytest.mark.slow
def test_every_step_is_a_child_run_with_its_metrics_and_artifacts(lifecycle, monkeypatch):
    uri, root, run, hub = lifecycle
    assert run.returncode == 0, run.stderr[-4000:]
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    client, exp, parent, _ = _runs(uri)
    runs = client.search_runs([exp.experiment_id])
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
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    # The fixture's pipeline run is the first; test_rerun_reuses_finished_steps and the kill test (the last two in this
    # module) add others.
    parent = next(r for r in runs if r.data.tags.get("slmsql.stage") == "pipeline")
    return client, exp, parent, {r.info.run_name: r for r in runs
                                 if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}


@pytest.mark.slow
def test_every_run_describes_its_result_in_documented_names(lifecycle):
    from slmsql.tracking import runs as tracking, vocabulary

    uri, root, run, _ = lifecycle
    assert run.returncode == 0, run.stderr[-4000:]
    client, exp, parent, children = _runs(uri)
    assert "Metric names: docs/vocabulary.md" in exp.tags[tracking.NOTE]
    for r in [parent, *children.values()]:
        stage = r.data.tags["slmsql.stage"]
        assert r.data.tags.get(tracking.NOTE), f"{r.info.run_name} has no description"
        assert not [k for k in r.data.metrics if not vocabulary.documented(k, stage)], r.info.run_name
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
        assert f"vs [eval-sft-{split}](#/experiments/" in grpo_eval.data.tags[tracking.NOTE]
    assert m["filter/band"] == children["filter"].data.metrics["band"]
    assert f"Filter: {m['filter/band']:.0f} band questions of {m['filter/n_source']:.0f}" in note


@pytest.mark.slow
def test_lineage_run_uris_and_dataset_inputs(lifecycle):
    uri, root, run, _ = lifecycle
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


@pytest.mark.slow
def test_card_states_the_measured_numbers(lifecycle):
    uri, root, run, hub = lifecycle
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


@pytest.mark.slow
def test_pushed_to_the_hub_and_registered(lifecycle, monkeypatch, tmp_path):
    """What arrived: the SFT model (its own commit and card, citing the runs that made it), the adapter naming it
    as base; the registry's text2sql model answers the dev questions with evaluate's SQL; no token anywhere."""
    uri, root, run, hub = lifecycle
    assert run.returncode == 0, run.stderr[-4000:]
    import mlflow
    import pandas as pd

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient()
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])}
    out = root / "out"

    assert sorted(hub.repos) == sorted([BASE_REPO, REPO]) and hub.unhandled == []
    assert [len(hub.repos[r]["commits"]) for r in (BASE_REPO, REPO)] == [1, 1]
    base, adapter = hub.files(BASE_REPO), hub.files(REPO)
    policy = out / "from-runs" / runs["sft"].info.run_id / "policy"
    assert base == {p.name: p.read_bytes() for p in (out / "publish" / "base").iterdir()}
    assert all(base[p.name] == p.read_bytes() for p in policy.iterdir())  # the SFT run's policy, as logged
    card = base["README.md"].decode()
    assert f"by slmsql sft run `{runs['sft'].info.run_id}`" in card and "A full fine-tune of the embedded tiny" in card
    assert f"slmsql tiny-model run `{runs['tiny-model'].info.run_id}`" in card
    assert adapter == {p.name: p.read_bytes() for p in (out / "publish").iterdir() if p.is_file()}
    assert f"base_model: {BASE_REPO}\n" in adapter["README.md"].decode()
    assert json.loads(adapter["adapter_config.json"])["base_model_name_or_path"] == BASE_REPO
    assert runs["grpo"].data.tags["slmsql.hub_commit"] == hub.repos[REPO]["commits"][0]["oid"]

    version = client.get_model_version_by_alias("toy-grpo", "candidate")
    assert version.run_id == runs["grpo"].info.run_id and version.tags["base_repo"] == BASE_REPO
    world = out / "from-runs" / runs["toy"].info.run_id / "toy"
    gold = [json.loads(line) for line in (world / "dev.jsonl").read_text().splitlines()]
    rows = [{"question": g["question"], "db_path": str(world / "databases" / g["db_id"] / f"{g['db_id']}.sqlite")}
            for g in gold]
    served = mlflow.pyfunc.load_model("models:/toy-grpo@candidate").predict(pd.DataFrame(rows))
    predictions = mlflow.artifacts.download_artifacts(run_id=runs["eval-grpo-dev"].info.run_id,
                                                      artifact_path="predictions.jsonl", dst_path=str(tmp_path))
    evaluated = {p["id"]: p["sql"] for p in map(json.loads, Path(predictions).read_text().splitlines())}
    assert [evaluated[g["id"]] for g in gold] == [None if pd.isna(s) else s for s in served["sql"]]

    token = hub.token
    assert token not in run.stdout + run.stderr
    for r in hub.requests:
        assert token.encode() not in (r["path"] + "?" + r["query"]).encode() + r["body"]
    for path in root.rglob("*"):
        assert not path.is_file() or token.encode() not in path.read_bytes(), path


@pytest.mark.slow
def test_models_tab_lists_each_policy_with_its_ex_per_eval_set(lifecycle):
    """The SFT policy and the GRPO adapter are LoggedModels of the runs that trained them, each with the EX of its
    evaluations on both eval sets, linked to that eval set's dataset; the registered text2sql version is the GRPO
    policy's model (run -> logged model -> version)."""
    from slmsql import configs
    from slmsql.tracking import descriptions, lineage, runs as tracking

    uri, root, run, _ = lifecycle
    assert run.returncode == 0, run.stderr[-4000:]
    client, exp, _, c = _runs(uri)
    models = {m.name: m for m in client.search_logged_models([exp.experiment_id])}
    assert {"sft", "grpo"} <= set(models)
    for stage, files in (("sft", "policy"), ("grpo", "adapter")):
        model, trained = models[stage], c[stage]
        assert model.source_run_id == trained.info.run_id and str(model.status) == "READY"
        assert trained.data.tags[lineage.MODEL_TAG] == model.model_id
        assert model.tags[lineage.FILES_TAG] == f"runs:/{trained.info.run_id}/{files}"
        ex = {m.dataset_name: (m.value, m.dataset_digest, m.run_id) for m in model.metrics if m.key == "ex"}
        assert {m.key for m in model.metrics} == {"ex"}  # the Models tab: one column per eval set
        assert set(ex) == {"toy-dev", "toy-dev_cross"}
        for split in ("dev", "dev_cross"):
            evaluation = c[f"eval-{stage}-{split}"]
            [digest] = {i.dataset.digest for i in evaluation.inputs.dataset_inputs if i.dataset.name == f"toy-{split}"}
            assert ex[f"toy-{split}"] == (evaluation.data.metrics["ex"], digest, evaluation.info.run_id)
        # its page stands alone: a description (what it is, the run that trained it, its EX per eval set, its tags:
        # the page shows none), only the params that define it, and an adapter's files (a full model's: a reference)
        note = model.tags[tracking.NOTE]
        assert note.startswith(f"{stage.upper()} policy (") and descriptions.run_link(trained) in note
        for split in ("dev", "dev_cross"):
            assert f"toy-{split} {100 * ex[f'toy-{split}'][0]:.1f}% ({descriptions.run_link(c[f'eval-{stage}-{split}'])})" in note
        assert f"`{lineage.FILES_TAG}` = {model.tags[lineage.FILES_TAG]}" in note
        assert not set(configs.RUN_ONLY) & set(model.params) and model.params["max_steps"] == trained.data.params["max_steps"]
    assert "(a full model: not copied here)" in models["sft"].tags[tracking.NOTE]  # the tiny model, fine-tuned in full
    got = {f.path for f in client.list_logged_model_artifacts(models["grpo"].model_id, "adapter")}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= got
    # each run that sampled or scored a policy names its model as an input
    used = {name: [i.model_id for i in client.get_run(c[name].info.run_id).inputs.model_inputs]
            for name in ("filter", "eval-sft-dev", "eval-grpo-dev_cross")}
    assert used == {"filter": [models["sft"].model_id], "eval-sft-dev": [models["sft"].model_id],
                    "eval-grpo-dev_cross": [models["grpo"].model_id]}
    # ranked on toy-dev; through the REST server (mlflow 3.17.2) a datasets clause without its digest matches no
    # model (the request carries an empty digest), so it names both, as the Models tab's dataset filter does
    dev_digest = ex["toy-dev"][1]
    ranked = client.search_logged_models([exp.experiment_id],
                                         datasets=[{"dataset_name": "toy-dev", "dataset_digest": dev_digest}],
                                         order_by=[{"field_name": "metrics.ex", "dataset_name": "toy-dev"}])
    assert {m.name for m in ranked} >= {"sft", "grpo"}
    version = client.get_model_version_by_alias("toy-grpo", "candidate")
    assert version.source == f"models:/{models['grpo'].model_id}"


BINARY = (".safetensors", ".bin", ".sqlite", ".png", ".parquet", ".pkl", ".pt")  # not scanned: no text in them


def _machine_folders(root) -> tuple[str, ...]:
    """The folders of this machine a store could name: the test's tmp root (output folder, store, Hub cache),
    the clone the code runs from, the Python environment, the temporary folder (tempfile's work folders)."""
    import tempfile

    import slmsql

    clone = Path(slmsql.__file__).resolve().parents[2]
    return tuple({str(root), str(root.resolve()), str(clone), sys.prefix, tempfile.gettempdir().rstrip("/") + "/"})


@pytest.mark.slow
def test_no_machine_path_anywhere_in_the_store_or_the_publish_folder(lifecycle, tmp_path):
    """What a run, a model, a card or a Hub upload keeps names runs (runs:/, models:/), Hub ids or project-relative
    paths, never a folder of this machine: every param, tag (descriptions and mlflow.source.* included), dataset
    source, artifact name and text artifact of every run, every LoggedModel's tags, params and text files,
    every registry version, and the publish folder. The one exception: the `output_dir` params, the location the
    user gave (outside the project here, so absolute; inside it, as in `make demo`, relative)."""
    import mlflow

    uri, root, run, _ = lifecycle
    assert run.returncode == 0, run.stderr[-4000:]
    client, exp, parent, children = _runs(uri)
    machine = _machine_folders(root)
    found, scanned = [], []

    def scan(where, text):
        if any(m in str(text) for m in machine):
            found.append((where, str(text)[:300]))

    def text_files(where, folder):
        for f in sorted(Path(folder).rglob("*")):
            if f.is_file() and f.suffix not in BINARY and b"\0" not in (data := f.read_bytes())[:4096]:
                scanned.append(f"{where}/{f.relative_to(folder)}")
                scan(f"{where}/{f.relative_to(folder)}", data.decode("utf-8", "replace"))

    def artifacts(run_id, name, path=None):
        for f in client.list_artifacts(run_id, path):
            scan(f"artifact name of {name}", f.path)
            if f.is_dir:
                artifacts(run_id, name, f.path)
            elif not f.path.endswith(BINARY):
                got = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=f.path,
                                                          dst_path=str(tmp_path / run_id), tracking_uri=uri)
                scanned.append(f"{name}:{f.path}")
                scan(f"{name} artifact {f.path}", Path(got).read_text(encoding="utf-8", errors="replace"))

    scan("experiment tags", exp.tags)
    for r in client.search_runs([exp.experiment_id]):  # every run in the store, not only the pipeline's
        name = r.info.run_name
        for k, v in r.data.params.items():
            if k != "output_dir":
                scan(f"{name} param {k}", v)
            if v in ("True", "False"):  # one spelling of booleans: the steps' (true/false)
                found.append((f"{name} param {k}", v))
        for k, v in r.data.tags.items():  # descriptions (mlflow.note.content) and mlflow.source.* included
            scan(f"{name} tag {k}", v)
        for i in r.inputs.dataset_inputs:
            scan(f"{name} dataset {i.dataset.name}", i.dataset.source)
        artifacts(r.info.run_id, name)
    for m in client.search_logged_models([exp.experiment_id]):
        scan(f"model {m.name} tags", m.tags)  # its description is the tag mlflow.note.content
        scan(f"model {m.name} params", m.params)
        if client.list_logged_model_artifacts(m.model_id):  # a full model's files stay its run's
            folder = tmp_path / "models" / m.model_id
            folder.mkdir(parents=True)
            text_files(f"model {m.name}", mlflow.artifacts.download_artifacts(
                artifact_uri=m.artifact_location, dst_path=str(folder), tracking_uri=uri))
    for v in client.search_model_versions():
        scan(f"version {v.name}/{v.version}", [v.tags, v.source, v.description])
    text_files("publish folder", root / "out" / "publish")  # what went to the Hub: adapter, base, both cards
    assert found == []
    # the scan read what it promises: each kind of text artifact, the adapter's config in the run, the model and the
    # Hub upload, the filter's data check, the published model's MLmodel
    for want in ("grpo:adapter/slmsql_grpo_config.json", "filter:data_check/rl.json", "publish:publish.json",
                 "eval-grpo-dev:results.jsonl", "publish folder/slmsql_grpo_config.json",
                 "publish folder/base/README.md", "model grpo/adapter/slmsql_grpo_config.json",
                 "model grpo/MLmodel"):
        assert any(s.endswith(want) or s == want for s in scanned), want
    # the card names its base by the run that trained it, and the GRPO run's adapter mode agrees with its params
    sft, grpo = children["sft"], children["grpo"]
    assert grpo.data.tags["slmsql.model"] == f"runs:/{sft.info.run_id}/policy" == grpo.data.params["model"]
    assert "slmsql.adapter_mode" not in grpo.data.tags and "slmsql.base_adapter" not in grpo.data.tags
    assert f"runs:/{sft.info.run_id}/policy" in (root / "out" / "publish" / "base" / "README.md").read_text()
    # descriptions link the baseline, the GRPO run's evaluations and each evaluation's sibling
    link = lambda r: f"[{r.info.run_name}](#/experiments/{exp.experiment_id}/runs/{r.info.run_id})"  # noqa: E731
    note = lambda r: r.data.tags["mlflow.note.content"]  # noqa: E731
    for split, other in (("dev", "dev_cross"), ("dev_cross", "dev")):
        grpo_eval = children[f"eval-grpo-{split}"]
        assert f"vs {link(children[f'eval-sft-{split}'])}: " in note(grpo_eval)
        assert link(children[f"eval-grpo-{other}"]) in note(grpo_eval) and link(grpo) in note(grpo_eval)
        assert link(grpo_eval) in note(grpo) and link(children[f"eval-sft-{split}"]) in note(sft)


@pytest.mark.slow
def test_the_view_puts_the_headline_first_and_every_pair_states_its_verdict(lifecycle):
    """The link the pipeline prints opens slmsql's view: grouped by eval set in the order runs started, so the
    pipeline run, grouped under the eval sets of its headline, is the first group; it carries every eval set's
    GRPO-vs-SFT result, each the result tag of that set's GRPO evaluation."""
    from slmsql.tracking import runs as tracking

    uri, root, run, _ = lifecycle
    assert run.returncode == 0, run.stderr[-4000:]
    client, exp, parent, c = _runs(uri)
    saved = json.loads(exp.tags[f"mlflow.sharedViewState.{tracking.VIEW_KEY}"])
    view = json.loads(saved["state"])  # in the envelope that lists it in the views menu by name
    assert saved["name"] == "slmsql"
    assert (view["orderByKey"], view["orderByAsc"]) == ("attributes.start_time", True)
    assert view["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": tracking.GROUP_BY}]
    grouped = client.search_runs([exp.experiment_id], f"tags.`{tracking.GROUP_BY}` != ''",
                                 order_by=["attributes.start_time ASC"])
    assert grouped[0].info.run_id == parent.info.run_id  # the UI orders groups by their first run
    assert parent.data.tags[tracking.GROUP_BY] == "toy-dev, toy-dev_cross"
    assert parent.data.tags[tracking.RESULT] == "; ".join(
        f"{split} GRPO vs SFT: {c[f'eval-grpo-{split}'].data.tags[tracking.RESULT]}" for split in ("dev", "dev_cross"))
    # each run's result in one cell, the training runs' too (the view has no metric column)
    filt, grpo = c["filter"], c["grpo"].data.metrics
    assert filt.data.tags[tracking.RESULT] == f"band {filt.data.metrics['band']:.0f} of {filt.data.metrics['n_source']:.0f} (0.2 < p < 0.8)"
    assert c["grpo"].data.tags[tracking.RESULT] == (
        f"correctness varied in {grpo['summary/exec/frac_groups_correctness_varies']:.0%} of groups, "
        f"{grpo['summary/frac_reward_zero_std']:.0%} zero-variance")
    assert c["sft"].data.tags[tracking.RESULT].startswith("loss ")
    assert tracking.ui_link(exp.experiment_id).split("/#/")[1] in run.stdout
    assert run.stdout.count("MLflow UI: ") >= 4  # each evaluation step printed it too
    assert "--backend-store-uri" not in run.stdout  # tracked through a server: its UI is up, no `mlflow ui` to start


@pytest.mark.slow
def test_the_ui_shows_the_verdicts_the_ex_columns_and_the_candidate(lifecycle, tmp_path):
    """In a real browser (Debian's headless Chromium, over its DevTools pipe) on the fixture's `mlflow server`:
    from Home, the docs' first step (sidebar switch "Model training", the experiment, Views -> slmsql) reaches
    each eval set's verdict; so does the link the pipeline printed, in the pipeline run's result cell and each
    GRPO evaluation's; the Models tab has an EX column per eval set with each policy's EX; the registry page
    lists the version aliased candidate."""
    from ci_env import in_ci
    from devtools import Chromium, binary

    uri, root, run, _ = lifecycle
    assert run.returncode == 0, run.stderr[-4000:]
    if binary() is None:
        if in_ci():
            pytest.fail("no chromium; under CI this test must run (.ci/run installs Debian's chromium)")
        pytest.skip("no chromium (Debian: apt-get install chromium)")
    link = run.stdout.split("MLflow UI: ")[-1].split()[0]  # the headline's link, printed last
    with Chromium(binary(), tmp_path / "profile") as browser:
        ui_checks(browser, uri, link)


def ui_checks(browser, uri: str, link: str) -> None:
    """The browser test's checks, against the pipeline's store behind `uri`."""
    from devtools import views_menu_from_home

    from slmsql.tracking import runs as tracking

    client, exp, parent, c = _runs(uri)
    size, result = (2000, 1000), f"tags.`{tracking.RESULT}`"
    verdicts = {c[f"eval-grpo-{split}"].info.run_id: c[f"eval-grpo-{split}"].data.tags[tracking.RESULT]
                for split in ("dev", "dev_cross")}
    verdicts[parent.info.run_id] = parent.data.tags[tracking.RESULT]

    def cells(run_id: str, column: str) -> str:  # JavaScript: a run's cell text in the grid, once it is there
        return (f"[...document.querySelectorAll('.ag-row[row-id$=\".{run_id}\"] .ag-cell')]"
                f".find(c => c.getAttribute('col-id') === {column!r})?.innerText")

    def verdict_cells() -> dict:
        return {run_id: browser.wait(cells(run_id, result), f"the result cell of run {run_id}")
                for run_id in verdicts}

    # From Home, as the docs' first step says, to slmsql's view in the Views menu
    views_menu_from_home(browser, uri, exp.experiment_id, size)
    item = f"[...document.querySelectorAll('[role=menuitem]')].find(e => e.innerText.trim() === {tracking.VIEW_KEY!r})"
    browser.wait(f"!!{item}", "slmsql in the Views menu")
    browser.js(f"{item}.click()")
    assert verdict_cells() == verdicts
    # the printed link: the same view directly
    browser.open(link, size, parent.info.run_name)
    assert verdict_cells() == verdicts

    # Models tab: one EX column per eval set (its dataset name and digest), each policy's EX in it
    browser.open(f"{uri}/#/experiments/{exp.experiment_id}/models?workflowType=machine_learning", size, "Source run")
    models = {m.name: m for m in client.search_logged_models([exp.experiment_id])}
    expected = {(m.model_id, metric.dataset_name, metric.dataset_digest): metric.value
                for m in (models["sft"], models["grpo"]) for metric in m.metrics if metric.key == "ex"}
    assert len(expected) == 4
    grid = json.loads(browser.wait(
        "(() => { const cells = [...document.querySelectorAll('.ag-row .ag-cell')].filter("
        "c => c.getAttribute('col-id').replaceAll('&quot;', '\"').startsWith('metrics.{')).map(c => [c.closest("
        "'.ag-row').getAttribute('row-id'), c.getAttribute('col-id').replaceAll('&quot;', '\"'), c.innerText]);"
        f" return cells.length >= {len(expected)} && JSON.stringify(cells); }})()", "the EX cells"))
    shown = {}
    for model_id, column, text in grid:
        key = json.loads(column.removeprefix("metrics."))
        if key["metricKey"] == "ex":
            shown[(model_id, key["datasetName"], key["datasetDigest"])] = float(text)
    assert shown == pytest.approx(expected, abs=5e-4)

    # the registry: the GRPO policy's text2sql model, its version aliased candidate
    version = client.get_model_version_by_alias("toy-grpo", "candidate")
    browser.open(f"{uri}/#/models/toy-grpo", size, "candidate")
    row = browser.wait("[...document.querySelectorAll('[role=row]')].map(r => r.innerText).find(t => /@\\s*candidate/"
                       ".test(t))", "the version row aliased candidate")
    assert row.startswith(f"Version {version.version}\n") and f"grpo_run\n: {version.run_id}" in row


DIE_AFTER_CHECKPOINT_2 = """
# sitecustomize for the first run only: the GRPO step, once its checkpoint-2 is saved, kills its whole process group
# (the pipeline with it), as a machine lost mid-training would
import os, signal, sys
if "grpo" in sys.argv[1:2]:
    from transformers.trainer_callback import CallbackHandler
    on_save = CallbackHandler.on_save
    def on_save_then_die(self, args, state, control):
        control = on_save(self, args, state, control)
        if state.global_step == 2:
            os.killpg(0, signal.SIGKILL)
        return control
    CallbackHandler.on_save = on_save_then_die
"""


@pytest.mark.slow
def test_rerun_reuses_finished_steps(lifecycle):
    """Second to last in this module: it adds a second pipeline run to the fixture's store (and the kill test,
    last, a third)."""
    uri, root, run, hub = lifecycle
    assert run.returncode == 0, run.stderr[-4000:]
    again = pipeline(uri, root, hub)
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stderr.count("reused run") == 10
    assert [len(hub.repos[r]["commits"]) for r in (BASE_REPO, REPO)] == [1, 1]  # a reused publish pushes nothing


@pytest.mark.slow
def test_a_pipeline_killed_in_grpo_goes_on_in_the_same_run(lifecycle):
    """Last in this module (after the rerun test, which counts the fixture's runs): `slmsql pipeline` with 6 GRPO
    steps instead of 3, in the fixture's store and output folder, so that toy, tiny-model, SFT and filter are reused
    rather than trained again, is killed (SIGKILL, pipeline and step together) after GRPO's checkpoint-2; the same
    command again, in a new process, reuses the finished steps, continues GRPO from its checkpoint in its own MLflow
    run (not a new one beside it) and evaluates and publishes that run's adapter."""
    import mlflow

    uri, root, _, _ = lifecycle
    hook = root / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(DIE_AFTER_CHECKPOINT_2)
    env = {**_machine(), "MLFLOW_TRACKING_URI": uri, "MLFLOW_DISABLE_TELEMETRY": "true", "PATH": _path(),
           "HF_HOME": str(root / "hf-home"), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    argv = [sys.executable, "-m", "slmsql.cli", "pipeline", "--output-dir", str(root / "out"), "--overrides",
            SHORT.replace("grpo.max_steps=3", "grpo.max_steps=6")]
    first = watched.run(argv, cwd=root, env={**env, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(hook), env["PYTHONPATH"]]))})
    assert first.returncode == -9, first.stderr[-4000:]
    assert first.stderr.count("reused run") == 4, first.stderr[-4000:]  # toy, tiny-model, sft, filter
    partial = root / "out" / "grpo.partial"
    assert (partial / "checkpoint-2").is_dir() and not (partial / "checkpoint-4").exists()
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("slmsql").experiment_id
    (killed,) = [r for r in client.search_runs([experiment])
                 if r.info.run_name == "grpo" and r.info.status == "RUNNING"]  # nobody was left to end it

    again = watched.run(argv, cwd=root, env=env)
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stderr.count("reused run") == 6  # toy, tiny-model, sft, filter, the two SFT evaluations
    assert f"step grpo           continues its unfinished run {killed.info.run_id}" in again.stderr
    resumed = client.get_run(killed.info.run_id)
    assert resumed.info.status == "FINISHED" and resumed.data.params["max_steps"] == "6"
    assert {m.step for m in client.get_metric_history(killed.info.run_id, "loss")} == set(range(1, 7))
    adapter = f"runs:/{killed.info.run_id}/adapter"
    evals = [r for r in client.search_runs([experiment], f"params.adapter = '{adapter}'")]
    assert sorted(r.info.run_name for r in evals) == ["eval-grpo-dev", "eval-grpo-dev_cross"]
    assert all(r.info.status == "FINISHED" for r in evals)
    assert client.search_runs([experiment], f"params.grpo_run = '{killed.info.run_id}'")[0].info.run_name == "publish"
    assert not partial.exists() and (root / "out" / "grpo" / "adapter" / "adapter_model.safetensors").is_file()
