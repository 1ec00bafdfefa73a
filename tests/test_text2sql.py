"""The shipped model, on the toy policy: GRPO -> evaluate -> publish (real push of base + adapter to the loopback
Hub stand-in) -> the registry's text2sql model answers as evaluate did, in-process and behind `mlflow models serve`;
the pushed pair loads with PEFT from the stand-in and gives the same logits.

One module fixture runs the real stages once (a 2-step GRPO on the tiny SFT policy, a greedy evaluation of its
adapter on 30 questions, publish --base-repo); the tests read what they left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import mlflow
import psutil
import pytest
import scripted
import torch
from hubstub import HubStub
import ports
import watched
from policy import policy_fixture, read, tracking_store, write  # noqa: F401  (the fixture)

from slmsql import configs
from slmsql.inputs.data import db_path

REPO, BASE_REPO, NAME = "stub-user/toy-grpo", "stub-user/toy-sft", "toy-grpo"
MAX_NEW_TOKENS = 48


@pytest.mark.parametrize("rows, message", [
    ([{"question": "", "schema": "CREATE TABLE t (a INT)"}], "row 1: field 'question': a non-empty string"),
    ([{"question": "How many?", "schema": "CREATE TABLE t (a INT)"}, {"question": "How many?"}],
     "row 2: give exactly one of the fields schema and db_path \\(got neither\\)"),
    ([{"question": "How many?", "schema": "CREATE TABLE t (a INT)", "db_path": "t.sqlite"}],
     "row 1: give exactly one of the fields schema and db_path \\(got schema and db_path\\)"),
])
def test_served_model_refuses_bad_rows_naming_row_and_field(rows, message):
    """The fast part of this module (no model): what the pyfunc refuses before it generates anything, as an
    invalid-parameter error (the scoring server answers 400 with the message, not 500)."""
    from mlflow.exceptions import MlflowException

    from slmsql.publishing import text2sql

    with pytest.raises(MlflowException, match="text2sql input: " + message) as e:
        text2sql.Text2SQL().predict(None, rows)
    assert e.value.error_code == "INVALID_PARAMETER_VALUE"


@pytest.fixture(scope="module")
def shipped(policy, tmp_path_factory):
    from slmsql.stages import evaluate, grpo, publish

    root = tmp_path_factory.mktemp("ship")
    uri = f"sqlite:///{root}/mlflow.db"
    band = write(root / "band.jsonl", [{**r, "pass_rate": 0.5, "k": 4, "n_correct": 2} for r in read(policy.train)[:8]])
    with tracking_store(uri), HubStub() as hub, pytest.MonkeyPatch.context() as mp:
        hub.configure_client(mp)
        mp.chdir(root)  # the publish run's artifacts (./mlruns) land in this folder, which the token scan reads
        find = scripted.question_of(read(band))
        with pytest.MonkeyPatch.context() as sampled:  # GRPO on scripted groups (1 right, 3 wrong): it trains
            scripted.install(sampled, policy.model, lambda p, i: scripted.right(find(p)) if i == 0 else scripted.WRONG,
                             group=4)
            grpo.main(configs.load(configs.GRPOStageConfig, None, {
                "data": str(band), "db_root": str(policy.db_root), "model": str(policy.model),
                "output_dir": str(root / "grpo"), "num_generations": 4, "per_device_train_batch_size": 8,
                "max_completion_length": 40, "max_steps": 2, "learning_rate": 0.02, "save_steps": 2,
                "completions_every": 2, "workers": 1, "lora_r": 8, "lora_alpha": 16}))
        client = mlflow.MlflowClient()
        grpo_run = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])[0].info.run_id
        evaluate.main(configs.load(configs.EvaluateConfig, None, {
            "data": str(policy.dev), "db_root": str(policy.db_root), "model": str(policy.model),
            "adapter": str(root / "grpo" / "adapter"), "output_dir": str(root / "eval"),
            "max_new_tokens": MAX_NEW_TOKENS, "workers": 1}))
        eval_run = [r for r in client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])
                    if r.data.tags["slmsql.stage"] == "evaluate"][0].info.run_id
        mp.setenv("HF_TOKEN", hub.token)
        result = publish.main(configs.PublishConfig(
            grpo_run=grpo_run, eval_runs=eval_run, repo_id=REPO, base_repo=BASE_REPO, endpoint=hub.url,
            output_dir=str(root / "publish")))
        yield {"root": root, "uri": uri, "hub": hub, "result": result, "grpo_run": grpo_run,
               "predictions": {r["id"]: r for r in read(root / "eval" / "predictions.jsonl")}}


@pytest.fixture
def store(shipped, monkeypatch):
    """This test talks to the fixture's tracking store (conftest pointed it at an empty one)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", shipped["uri"])
    mlflow.set_tracking_uri(shipped["uri"])
    return shipped


def dev_rows(policy, how: str) -> tuple[list[str], list[dict]]:
    """The evaluated questions as model input rows: with the database's path, or with its schema text."""
    from slmsql.inputs.prompts import MAX_CHARS, schema_text

    ids, rows = [], []
    for r in read(policy.dev):
        path = db_path(policy.db_root, r["db_id"])
        source = {"db_path": str(path)} if how == "db_path" else \
            {"schema": schema_text(path, 0, MAX_CHARS, "compact")[0]}
        ids.append(r["id"])
        rows.append({"question": r["question"], **source, **({"evidence": r["evidence"]} if r.get("evidence") else {})})
    return ids, rows


@pytest.mark.parametrize("how", ["db_path", "schema"])
def test_registered_model_answers_as_evaluate_did(store, policy, how):
    import pandas as pd

    loaded = mlflow.pyfunc.load_model(f"models:/{NAME}@candidate")
    ids, rows = dev_rows(policy, how)
    out = loaded.predict(pd.DataFrame(rows))
    assert list(out.columns) == ["sql", "completion"] and len(out) == len(ids) == 30
    preds = store["predictions"]
    assert [preds[i]["completion"] for i in ids] == list(out["completion"])  # greedy: the same text ...
    assert [preds[i]["sql"] for i in ids] == [None if pd.isna(s) else s for s in out["sql"]]  # ... and SQL


def test_registered_model_is_the_published_one(store, policy):
    """The alias points at the text2sql model logged to the GRPO run, holding the pushed base and adapter."""
    from safetensors.torch import load_file

    client = mlflow.MlflowClient()
    version = client.get_model_version_by_alias(NAME, "candidate")
    assert version.source == store["result"]["text2sql_model"] and version.run_id == store["grpo_run"]
    assert version.tags["base_repo"] == BASE_REPO and version.tags["base_commit"] == store["result"]["base_hub_commit"]
    model = mlflow.pyfunc.load_model(f"models:/{NAME}@candidate").unwrap_python_model()._model[0]
    adapter = load_file(store["root"] / "grpo" / "adapter" / "adapter_model.safetensors")
    state = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(state) == len(adapter) and all(
        torch.equal(v, state[k.replace(".weight", ".default.weight")]) for k, v in adapter.items())
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # trained: B starts at zero


def test_bad_rows_are_refused_with_the_row_named(store):
    from mlflow.exceptions import MlflowException

    loaded = mlflow.pyfunc.load_model(f"models:/{NAME}@candidate")
    with pytest.raises(MlflowException, match="row 2: give exactly one of the fields schema and db_path"):
        loaded.predict([{"question": "q?", "schema": "CREATE TABLE t (a INT);"}, {"question": "q?"}])
    with pytest.raises(MlflowException, match="no such database"):
        loaded.predict([{"question": "q?", "db_path": str(store["root"] / "nowhere.sqlite")}])


# ---- mlflow models serve ---------------------------------------------------------------------------------

def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=watched.STALL_S) as r:  # a generation, on a busy machine
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_mlflow_models_serve_answers_invocations(store, policy, tmp_path):
    env = {**os.environ, "MLFLOW_TRACKING_URI": store["uri"], "PATH": f"{sys.prefix}/bin:{os.environ['PATH']}",
           "HF_HUB_OFFLINE": "1"}  # the base is inside the model: serving needs no Hub
    log = open(tmp_path / "serve.log", "wb")
    tree = set()

    def serve(port):
        return subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", f"models:/{NAME}@candidate",
                                 "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port), "-w", "1"],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def pings(port):
        tree.update((q.pid, q.create_time()) for q in ports.tree(proc_of[port].pid))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5) as r:
            return r.status == 200

    proc_of = {}
    proc, port = ports.start_serving(lambda p: proc_of.setdefault(p, serve(p)), pings,
                                     describe=lambda: (tmp_path / "serve.log").read_text())
    try:
        tree.update((q.pid, q.create_time()) for q in ports.tree(proc.pid))
        ids, by_path = dev_rows(policy, "db_path")
        _, by_schema = dev_rows(policy, "schema")
        request = {"dataframe_records": [by_path[0], by_schema[1]]}
        status, response = post(f"http://127.0.0.1:{port}/invocations", request)
        print("REQUEST", json.dumps(request), "\nRESPONSE", status, json.dumps(response))
        assert status == 200
        preds = store["predictions"]
        assert response == {"predictions": [{"sql": preds[i]["sql"], "completion": preds[i]["completion"]}
                                             for i in ids[:2]]}
        status, error = post(f"http://127.0.0.1:{port}/invocations", {"dataframe_records": [{"question": "q"}]})
        assert status == 400 and "give exactly one of the fields schema and db_path" in error["message"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=watched.STALL_S)
        log.close()
    procs = []  # the CLI and uvicorn, as they were (a pid reused since is another process)
    for pid, started in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            q = psutil.Process(pid)
            if q.create_time() == started:
                procs.append(q)
    # uvicorn's worker exits after its parent: wait for each to end (a zombie has ended), failing past the ceiling
    _, alive = psutil.wait_procs(procs, timeout=watched.STALL_S)
    alive = [" ".join(q.cmdline()) for q in alive if q.status() != psutil.STATUS_ZOMBIE]
    assert len(tree) >= 2 and alive == []  # the CLI and uvicorn, both gone: nothing of theirs listens any more


# ---- the pushed pair -------------------------------------------------------------------------------------

def test_pushed_pair_loads_with_peft_and_gives_the_same_logits(store, policy, monkeypatch):
    """Base and adapter downloaded back from the stand-in by the real client (transformers / PEFT from_pretrained
    with repo ids) give the logits of the local base + adapter; the adapter changes them."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slmsql.policy.models import load_model

    hub = store["hub"]
    hub.configure_client(monkeypatch)
    base = AutoModelForCausalLM.from_pretrained(BASE_REPO)
    pushed = PeftModel.from_pretrained(base, REPO).eval()
    tokenizer = AutoTokenizer.from_pretrained(BASE_REPO)
    local, _ = load_model(policy.model, store["root"] / "grpo" / "adapter")
    plain, _ = load_model(policy.model)
    ids = tokenizer(read(policy.dev)[0]["question"], return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        got, want, without = (m(input_ids=ids).logits for m in (pushed, local, plain))
    assert torch.equal(got, want) and not torch.equal(got, without)
    assert hub.unhandled == []


def test_what_arrived_on_the_hub(store, policy):
    hub, out = store["hub"], store["root"] / "publish"
    assert sorted(hub.repos) == sorted([BASE_REPO, REPO])
    assert [len(hub.repos[r]["commits"]) for r in (BASE_REPO, REPO)] == [1, 1]
    base_files = hub.files(BASE_REPO)
    assert base_files == {p.name: p.read_bytes() for p in (out / "base").iterdir()}
    for name in set(base_files) - {"README.md"}:  # the SFT policy, as it is
        assert base_files[name] == (policy.model / name).read_bytes()
    assert hub.files(REPO) == {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert json.loads(hub.files(REPO)["adapter_config.json"])["base_model_name_or_path"] == BASE_REPO
    card = hub.files(REPO)["README.md"].decode()
    assert f"base_model: {BASE_REPO}\n" in card and f"[`{BASE_REPO}`](https://huggingface.co/{BASE_REPO})" in card
    base_card = base_files["README.md"].decode()
    assert f"by slmsql sft run `{policy.sft_run_id}`" not in base_card  # that run lives in the fixture's own store
    assert "whose origin no MLflow run records" in base_card and f"[`{REPO}`]" in base_card
    token = hub.token.encode()
    for r in hub.requests:
        assert token not in (r["path"] + "?" + r["query"]).encode() + r["body"]
    for path in store["root"].rglob("*"):
        assert not path.is_file() or token not in path.read_bytes(), path
