"""A trained policy's LoggedModel (tracking/lineage.py): made when its run starts, finalized with the run's end through
the outbox (so an outage loses it no more than the run's metrics), found again by the evaluation of its files."""

import mlflow
import pytest

from slmsql.tracking import durable, lineage


def _training_run(stage="grpo"):
    run = mlflow.start_run(run_name=stage)
    mlflow.set_tag("slmsql.stage", stage)
    mlflow.log_params({"model": "runs:/" + "a" * 32 + "/policy", "learning_rate": "1e-05"})
    return run


@pytest.mark.parametrize("status, final", [("FINISHED", "READY"), ("FAILED", "FAILED")])
def test_policy_model_is_an_output_of_its_run_and_ends_with_it(tmp_path, status, final):
    run = _training_run()
    run_id = run.info.run_id
    model_id = lineage.start_policy_model(run_id, "grpo", "adapter")
    box = durable.Outbox(tmp_path / "out.outbox", wait=0)
    box.start(run_id, background=False)
    box.track_model(model_id)
    box.end_run(status)
    client = mlflow.MlflowClient()
    assert str(client.get_logged_model(model_id).status) == "PENDING"  # the final status waits in the outbox
    durable.sync(tmp_path / "out.outbox")
    model = client.get_logged_model(model_id)
    assert str(model.status) == final and model.name == "grpo" and model.source_run_id == run_id
    assert model.tags[lineage.FILES_TAG] == f"runs:/{run_id}/adapter"  # a reference, no copy of the weights
    assert model.params == {"model": "runs:/" + "a" * 32 + "/policy", "learning_rate": "1e-05"}
    got = client.get_run(run_id)
    assert got.data.tags[lineage.MODEL_TAG] == model_id
    assert [o.model_id for o in got.outputs.model_outputs] == [model_id]
    # a resumed run keeps the model it started with
    assert lineage.start_policy_model(run_id, "grpo", "adapter") == model_id
    assert len(client.search_logged_models([got.info.experiment_id])) == 1


def test_a_sweep_cells_run_name_becomes_a_valid_model_name():
    """A sweep cell is named by its grid values (`grpo runs_tier=0.1 seed=0`); MLflow refuses '.', '/', ':' ... in a
    LoggedModel's name, so those become '_' and the cell still gets its model."""
    with _training_run() as run:
        model_id = lineage.start_policy_model(run.info.run_id, "grpo runs_tier=0.1 base=org/m:v1 seed=0", "adapter")
    assert mlflow.MlflowClient().get_logged_model(model_id).name == "grpo runs_tier=0_1 base=org_m_v1 seed=0"


def test_an_evaluation_finds_the_model_of_the_run_that_trained_its_policy(tmp_path):
    with _training_run("sft") as sft:
        model_id = lineage.start_policy_model(sft.info.run_id, "sft", "policy")
    sft_id = sft.info.run_id
    local = tmp_path / "out" / "from-runs" / sft_id / "policy"  # the fetched copy an evaluation loads
    assert lineage.model_of("base-model", f"runs:/{sft_id}/policy") == model_id
    assert lineage.model_of(str(local)) == model_id
    assert lineage.model_of("HuggingFaceTB/SmolLM2-135M-Instruct") is None  # no run trained it
    assert lineage.trained_by(str(local), f"runs:/{'b' * 32}/adapter") == "b" * 32  # the adapter is the policy
    assert lineage.model_of(f"runs:/{'c' * 32}/policy") is None  # no such run in this store


def test_a_model_no_run_trained_is_one_external_model_for_every_run_that_uses_it(tmp_path, monkeypatch):
    """A Hub model evaluated zero-shot (or a folder in the project) has no training run: its EX goes to an external
    LoggedModel named by its Hub id or project path, found again by the next run; a folder outside the project,
    an adapter of unknown origin or a predictions file get none (no name that means the same elsewhere)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "base").mkdir(parents=True)
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    with mlflow.start_run() as run:
        exp = run.info.experiment_id
        hub = lineage.policy_model(exp, hub_id)
        assert lineage.policy_model(exp, hub_id) == hub  # found again, not a second model
        local = lineage.policy_model(exp, str(tmp_path / "models" / "base"))
        lineage.log_model_input(run.info.run_id, hub)
    client = mlflow.MlflowClient()
    model = client.get_logged_model(hub)
    assert (model.name, str(model.status), model.tags[lineage.FILES_TAG]) == (
        "HuggingFaceTB_SmolLM2-135M-Instruct", "READY", hub_id)
    assert client.get_logged_model(local).tags[lineage.FILES_TAG] == "models/base"
    assert lineage.policy_model(exp, "/elsewhere/model") is None
    assert lineage.policy_model(exp, hub_id, "/some/adapter") is None
    assert lineage.policy_model(exp, "") is None
    assert [i.model_id for i in client.get_run(run.info.run_id).inputs.model_inputs] == [hub]
    assert len(client.search_logged_models([exp])) == 2


def test_an_adapter_of_unknown_origin_credits_no_model(tmp_path, monkeypatch):
    """A GRPO adapter in a local folder on the SFT policy's run URI: no run is known to have trained the adapter, so
    its EX goes to no LoggedModel; above all not to the SFT model, whose page would show a GRPO policy's EX."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "grpo").mkdir(parents=True)
    with _training_run("sft") as sft:
        lineage.start_policy_model(sft.info.run_id, "sft", "policy")
    base = f"runs:/{sft.info.run_id}/policy"
    local_base = str(tmp_path / "outputs" / "from-runs" / sft.info.run_id / "policy")  # its fetched copy
    with mlflow.start_run() as run:
        for model in (base, local_base):
            assert lineage.trained_by(model, "outputs/grpo") is None
            assert lineage.policy_model(run.info.experiment_id, model, str(tmp_path / "outputs" / "grpo")) is None
    assert len(mlflow.MlflowClient().search_logged_models([run.info.experiment_id])) == 1  # the SFT model alone


def test_a_folder_retrained_in_place_is_a_new_external_model(tmp_path, monkeypatch):
    """A project folder's external model is found again by its path and what the folder holds (a digest of its
    files, tag `slmsql.digest`): `outputs/sft` retrained with --overwrite is a new model, not the old one's EX."""
    import random
    import shutil

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "outputs" / "sft"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    weights = folder / "model.safetensors"
    weights.write_bytes(random.Random(0).randbytes(6 << 20))
    with mlflow.start_run() as run:
        exp = run.info.experiment_id
        first = lineage.policy_model(exp, str(folder))
        assert lineage.policy_model(exp, "outputs/sft") == first  # the same files, by any spelling of the path
        retrained = bytearray(weights.read_bytes())
        retrained[3 << 20:(3 << 20) + 4096] = bytes(4096)  # a few KiB in the middle moved: same size, same config
        weights.write_bytes(retrained)
        second = lineage.policy_model(exp, "outputs/sft")
        assert second != first and lineage.policy_model(exp, "outputs/sft") == second
    client = mlflow.MlflowClient()
    old, new = client.get_logged_model(first), client.get_logged_model(second)
    assert old.tags[lineage.FILES_TAG] == new.tags[lineage.FILES_TAG] == "outputs/sft"
    assert new.tags[lineage.DIGEST_TAG] == lineage.digest(folder) != old.tags[lineage.DIGEST_TAG]
    shutil.copytree(folder, tmp_path / "copy")  # content, not the path or the files' times
    assert lineage.digest(tmp_path / "copy") == lineage.digest(folder)


def test_descriptions_link_related_runs_once_however_often_linked():
    from slmsql.tracking import descriptions, runs as tracking

    with mlflow.start_run(run_name="grpo") as grpo:
        tracking.describe("GRPO, 3 steps.")
    evals = []
    for name in ("eval-grpo-dev", "eval-grpo-dev_cross"):
        with mlflow.start_run(run_name=name) as r:
            evals.append(r)
    client = mlflow.MlflowClient()
    for _ in range(2):  # a reused run is linked again: replaced, not appended
        descriptions.link_runs(client.get_run(grpo.info.run_id), {"Evaluations:": evals, "Nothing:": []})
    exp = grpo.info.experiment_id
    assert client.get_run(grpo.info.run_id).data.tags[tracking.NOTE] == (
        f"GRPO, 3 steps.\n\nRelated runs: Evaluations: [eval-grpo-dev](#/experiments/{exp}/runs/{evals[0].info.run_id}),"
        f" [eval-grpo-dev_cross](#/experiments/{exp}/runs/{evals[1].info.run_id}).")


def test_training_charts_start_with_the_signal_and_constant_clip_ratios_wait():
    """The learning signal is also logged under a name that sorts first (the UI orders chart sections by name);
    a clip ratio is held back while it keeps its first value, and logged from its first step once it moves."""
    from slmsql.tracking import vocabulary
    from slmsql.training.hf_trainer import StepMetrics

    steps = StepMetrics()
    logs = lambda clip, reward: {"reward": reward, "reward_std": 0.5, "clip_ratio/low_mean": clip,  # noqa: E731
                                 "exec/frac_groups_correctness_varies": 1.0, "frac_reward_zero_std": 0.0, "loss": 1}
    first = steps.points(logs(0.0, 0.2), 1)
    assert first == [(1, {"reward": 0.2, "0_signal/reward": 0.2, "reward_std": 0.5, "0_signal/reward_std": 0.5,
                          "exec/frac_groups_correctness_varies": 1.0,
                          "0_signal/exec/frac_groups_correctness_varies": 1.0, "frac_reward_zero_std": 0.0,
                          "0_signal/frac_reward_zero_std": 0.0, "loss": 1.0})]
    assert sorted(first[0][1])[:4] == [f"0_signal/{k}" for k in sorted(vocabulary.SIGNAL)]
    assert "clip_ratio/low_mean" not in steps.points(logs(0.0, 0.3), 2)[0][1]  # still 0: held
    moved = steps.points(logs(0.1, 0.3), 3)
    clip = [(s, m["clip_ratio/low_mean"]) for s, m in moved if "clip_ratio/low_mean" in m]
    assert clip == [(1, 0.0), (2, 0.0), (3, 0.1)]
    assert steps.points(logs(0.1, 0.3), 4)[0][1]["clip_ratio/low_mean"] == 0.1  # moving: logged every step
    assert all(vocabulary.documented(k, "grpo") for _, m in moved for k in m)


def test_text2sql_is_logged_into_the_grpo_policys_model(tmp_path):
    """publish's servable model goes into the LoggedModel the GRPO run made (an output of that run already), so
    run -> logged model -> registered version is one line; a second, different one gets a model of its own."""
    from slmsql.publishing import text2sql

    with _training_run("grpo") as grpo:
        policy = lineage.start_policy_model(grpo.info.run_id, "grpo", "adapter")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    config = {"base_model": "org/base", "grpo_run": grpo.info.run_id}
    with mlflow.start_run(run_name="publish"):
        uri, reused = text2sql.log_text2sql(grpo.info.run_id, adapter, config, {"adapter": "c1"}, into=policy)
        assert (uri, reused) == (f"models:/{policy}", False)
        assert text2sql.log_text2sql(grpo.info.run_id, adapter, config, {"adapter": "c1"}, into=policy) == (uri, True)
        other, _ = text2sql.log_text2sql(grpo.info.run_id, adapter, config, {"adapter": "c2"}, into=policy)
    assert other != uri
    model = mlflow.get_logged_model(policy)
    assert str(model.status) == "READY" and model.source_run_id == grpo.info.run_id
    assert "It also holds the servable `text2sql` MLflow model" in model.tags["mlflow.note.content"]
    outputs = [o.model_id for o in mlflow.get_run(grpo.info.run_id).outputs.model_outputs]
    assert outputs.count(policy) == 1 and set(outputs) == {policy, other.removeprefix("models:/")}
    version = mlflow.register_model(uri, "text2sql-test")
    assert version.run_id == grpo.info.run_id and version.source == uri
    # its MLmodel names where each artifact came from: as named in the folder publish gave, not that folder
    mlmodel = mlflow.artifacts.download_artifacts(artifact_uri=f"{model.artifact_location}/MLmodel",
                                                  dst_path=str(tmp_path / "got"))
    text = open(mlmodel).read()
    assert "uri: adapter\n" in text and str(tmp_path) not in text


def test_a_policy_model_page_stands_alone(tmp_path):
    """A LoggedModel's page shows its description (the tag mlflow.note.content, as a run's), its params and its
    artifacts, not its tags: the description says what the model is, which run trained it on what, where its files
    are and its slmsql tags, and follows its EX per eval set; the params are only those that define it; an
    adapter's files come into the model through the outbox with the run's end, a full model stays a reference."""
    from slmsql.tracking import runs as tracking

    client = mlflow.MlflowClient()
    with _training_run("grpo") as grpo:
        mlflow.log_params({"data": "runs:/" + "d" * 32 + "/band.jsonl", "output_dir": "/home/me/out/grpo",
                           "overwrite": "true", "run_name": "grpo", "workers": "2", "trainer_args.warmup_ratio": "0.1"})
        model_id = lineage.start_policy_model(grpo.info.run_id, "grpo", "adapter")
        adapter = tmp_path / "adapter"
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text('{"r": 8}')
        box = durable.Outbox(tmp_path / "out.outbox", wait=0)
        box.start(grpo.info.run_id, background=False)
        box.track_model(model_id)
        box.log_model_artifact(model_id, adapter)
        box.end_run("FINISHED")
    durable.sync(tmp_path / "out.outbox")
    model = client.get_logged_model(model_id)
    assert set(model.params) == {"model", "learning_rate", "data", "trainer_args.warmup_ratio"}
    assert [f.path for f in client.list_logged_model_artifacts(model_id)] == ["adapter"]
    note = model.tags[tracking.NOTE]
    exp, run_id = grpo.info.experiment_id, grpo.info.run_id
    assert note.startswith(f"GRPO policy (a LoRA adapter), trained by run [grpo](#/experiments/{exp}/runs/{run_id}) "
                           f"on `runs:/{'d' * 32}/band.jsonl`, starting from `runs:/{'a' * 32}/policy`.")
    assert f"this model's artifacts, `adapter/`" in note and "EX per eval set: not evaluated yet." in note
    assert f"`{lineage.FILES_TAG}` = runs:/{run_id}/adapter" in note and "`slmsql.policy_kind` = adapter" in note

    with mlflow.start_run(run_name="eval-grpo-dev") as ev:  # an evaluation logs EX to the model: its page says so
        (tmp_path / "dev.jsonl").write_text('{"id": "q1"}\n')
        data = tracking.log_dataset([{"id": "q1"}], "toy-dev", tmp_path / "dev.jsonl", context="evaluation")
        mlflow.log_metrics({"ex": 0.375}, model_id=model_id, dataset=data)
        lineage.describe_model(model_id)
    note = client.get_logged_model(model_id).tags[tracking.NOTE]
    assert f"EX per eval set: toy-dev 37.5% ([eval-grpo-dev](#/experiments/{exp}/runs/{ev.info.run_id}))." in note

    with _training_run("sft") as sft:  # a full fine-tune: a reference, said so
        full = lineage.start_policy_model(sft.info.run_id, "sft", "policy", adapter=False)
    note = client.get_logged_model(full).tags[tracking.NOTE]
    assert note.startswith("SFT policy (a full model)") and "(a full model: not copied here)" in note
