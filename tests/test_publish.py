"""publish: card from MLflow runs, one Hub commit (against the loopback stand-in), registry version, no token leaks.

One module-level MLflow store holds the input runs (a GRPO run with a real tiny PEFT adapter, a filter run,
SFT and GRPO evaluation runs); each test gets its own copy of that store, so tests cannot see each other.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import tomllib
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
import watched

from hubstub import HubStub
from slmsql.stats import inference as stats
from slmsql.configs import (
    EvaluateConfig, FilterConfig, GRPOStageConfig, PublishConfig, SFTStageConfig, SweepConfig, to_params
)
from slmsql.errors import SlmsqlError
from slmsql.sql.scoring import ex_summary as summarize

BASE = "slmsql-test/tiny-qwen2"  # what the runs name; the weights sit in a Hub-cache snapshot of that id
REPO = "stub-user/tiny-grpo"
TEXTS = ["CREATE TABLE item (id INTEGER, name TEXT, price REAL)", "How many items cost more than 2?",
         "SELECT count(*) FROM item WHERE price > 2", "SELECT name FROM item ORDER BY price DESC LIMIT 1"] * 4
FILTER_SUMMARY = {"n_source": 51, "k": 8, "low": 0.2, "high": 0.8,
                  "buckets": {"band": 12, "all_fail": 20, "all_pass": 9, "out_of_band": {"1/8": 5, "7/8": 4},
                              "errors": 1},
                  "histogram": {"0/8": 20, "1/8": 5, "2/8": 3, "3/8": 3, "4/8": 2, "5/8": 2, "6/8": 2, "7/8": 4,
                                "8/8": 9}, "error_ids": ["q50"]}


def pairs(both_right: int, only_a: int, only_b: int, both_wrong: int) -> tuple[list[bool], list[bool]]:
    a = [True] * both_right + [True] * only_a + [False] * only_b + [False] * both_wrong
    b = [True] * both_right + [False] * only_a + [True] * only_b + [False] * both_wrong
    return a, b


def metrics_json(correct: list[bool], baseline: list[bool] | None = None, baseline_run: str = "") -> dict:
    rows = [{"correct": c, "status": "ok" if c else "error", "difficulty": "simple" if i % 2 else "moderate"}
            for i, c in enumerate(correct)]
    m = summarize(rows)
    if baseline is not None:
        m["comparison"] = {"baseline_run": baseline_run, **stats.compare(correct, baseline)}
    return m


def build_adapter(root: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slmsql.toy.tiny_model import build_tiny_model

    snapshot = build_tiny_model(root / "hub" / "models--slmsql-test--tiny-qwen2" / "snapshots" / ("0" * 40), TEXTS,
                                vocab_size=300, hidden=32, layers=1, heads=4, ffn=64)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(snapshot),
                           LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear",
                                      task_type="CAUSAL_LM"))
    adapter = root / "adapter"
    model.save_pretrained(adapter)
    AutoTokenizer.from_pretrained(snapshot).save_pretrained(adapter)
    (adapter / "slmsql_grpo_config.json").write_text(json.dumps({"model": BASE, "lora_r": 8}))
    return adapter


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The input runs, in a template store that each test copies."""
    import mlflow
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag

    root = tmp_path_factory.mktemp("world")
    adapter = build_adapter(root)
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{root}/template.db")
    exp = client.create_experiment("inputs", artifact_location=str(root / "artifacts"))
    now = int(time.time() * 1000)

    def run(stage: str, cfg, tags: dict, metrics: dict, artifacts: dict, history: dict | None = None) -> str:
        r = client.create_run(exp, tags={"slmsql.stage": stage, **tags})
        rid = r.info.run_id
        client.log_batch(rid, params=[Param(k, v) for k, v in to_params(cfg).items()],
                         metrics=[Metric(k, v, now, 0) for k, v in metrics.items()] +
                         [Metric(k, v, now, s) for k, vs in (history or {}).items() for s, v in enumerate(vs, 1)],
                         tags=[RunTag(k, v) for k, v in tags.items()])
        for name, content in artifacts.items():
            if isinstance(content, Path):
                client.log_artifacts(rid, str(content), name)
            else:
                path = root / "upload" / rid / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(content))
                client.log_artifact(rid, str(path))
        client.set_terminated(rid)
        return rid

    ids = {}
    grpo_cfg = GRPOStageConfig(model=BASE, base_adapter="adapters/sft", max_steps=40, learning_rate=1e-5,
                               data="outputs/filter/band.jsonl", advantage_gate="correctness", dynamic_sampling=True)
    summary = {"summary/reward": 0.61, "summary/reward_std": 0.44, "summary/frac_reward_zero_std": 0.12,
               "summary/grad_norm": 0.5, "summary/exec/correct": 0.48, "summary/dynamic_sampling/extra_rounds": 1.5,
               "summary/exec/frac_groups_correctness_varies": 0.81, "summary/completions/mean_length": 80.5,
               "train_seconds": 9720.0, "steps": 40}
    ids["grpo"] = run("grpo", grpo_cfg, {"slmsql.model": BASE, "slmsql.base_adapter": "adapters/sft",
                                         "slmsql.adapter_mode": "continue"}, summary,
                      {"adapter": adapter, "summary.json": summary},
                      history={"frac_reward_zero_std": [0.2, 0.1, 0.05], "reward_std": [0.4, 0.45, 0.47]})
    band = mlflow.data.from_pandas(pd.DataFrame({"id": [f"q{i}" for i in range(12)]}), source="band.jsonl", name="rl")
    client.log_inputs(ids["grpo"], [DatasetInput(band._to_mlflow_entity(),
                                                 [InputTag("mlflow.data.context", "training")])])
    ids["filter"] = run("filter", FilterConfig(model=BASE, adapter="adapters/sft"),
                        {"slmsql.model": BASE, "slmsql.adapter": "adapters/sft"},
                        {"n_source": 51, "band": 12}, {"summary.json": FILTER_SUMMARY})

    def evaluate(dataset: str, adapter_tag: str, correct, baseline=None, baseline_run="", model=BASE) -> str:
        cfg = EvaluateConfig(data=f"data/{dataset}.jsonl", db_root="dbs", model=model, adapter=adapter_tag,
                             baseline_run=baseline_run, dataset_name=dataset)
        tags = {"slmsql.dataset": dataset, "slmsql.match": "bird", "slmsql.model": model,
                "slmsql.adapter": adapter_tag}
        m = metrics_json(correct, baseline, baseline_run)
        return run("evaluate", cfg, tags, {"ex": m["ex"]}, {"metrics.json": m})

    # the seed's numbers: BIRD 55/149 -> 54/149, Spider 164/200 -> 166/200 (a null result) ...
    bird_a, bird_b = pairs(50, 4, 5, 90)
    spider_a, spider_b = pairs(160, 6, 4, 30)
    # ... and an improvement on BIRD: 55/149 -> 80/149
    better_a, better_b = pairs(52, 28, 3, 66)
    ids["sft_bird"] = evaluate("bird", "adapters/sft", bird_b)
    ids["sft_spider"] = evaluate("spider", "adapters/sft", spider_b)
    ids["grpo_bird"] = evaluate("bird", "outputs/grpo/adapter", bird_a, bird_b, ids["sft_bird"])
    ids["grpo_spider"] = evaluate("spider", "outputs/grpo/adapter", spider_a, spider_b, ids["sft_spider"])
    ids["better_bird"] = evaluate("bird", "outputs/grpo/adapter", better_a, better_b, ids["sft_bird"])
    ids["other_base"] = evaluate("bird", "outputs/grpo/adapter", bird_a, model="other-org/other-model")
    # the same answers evaluated alone, without a baseline, as a study's cells are
    ids["alone_bird"] = evaluate("bird", "outputs/grpo/adapter", bird_a)
    ids["alone_spider"] = evaluate("spider", "outputs/grpo/adapter", spider_a)

    # an adapter on a local checkpoint (a full fine-tune): publishable as a dry run only
    snapshot = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    policy = shutil.copytree(snapshot, root / "sft-policy")
    local_adapter = shutil.copytree(adapter, root / "local-adapter")
    conf = json.loads((local_adapter / "adapter_config.json").read_text())
    (local_adapter / "adapter_config.json").write_text(json.dumps({**conf, "base_model_name_or_path": str(policy)}))
    ids["local_grpo"] = run("grpo", dataclasses.replace(grpo_cfg, model=str(policy), base_adapter=""),
                            {"slmsql.model": str(policy), "slmsql.base_adapter": "", "slmsql.adapter_mode": "none"},
                            summary, {"adapter": local_adapter})
    ids["local_eval"] = evaluate("toy-dev", "outputs/grpo/adapter", bird_a, model=str(policy))

    # a sweep whose cell (variant `defaults`, seed 1) is the GRPO run above, evaluated by grpo_bird / grpo_spider
    sweep_dir = root / "sweep-report"
    sweep_dir.mkdir()
    write_json_file(sweep_dir / "sweep.json", sweep_report(ids))
    ids["sweep"] = run("sweep", SweepConfig(grid="defaults; runs_tier=0 format_tier=0", model=BASE,
                                            eval_data=["data/bird.jsonl", "data/spider.jsonl"],
                                            eval_names=["bird", "spider"]), {}, {"cells": 6},
                       {"report": sweep_dir})
    # the SFT run that wrote that checkpoint (found by its --output-dir): the pushed base's card cites it
    ids["sft"] = run("sft", SFTStageConfig(model=BASE, output_dir=str(policy), data="toy/sft.jsonl", max_steps=300),
                     {"slmsql.model": BASE, "slmsql.policy_kind": "full"}, {"steps": 300, "train_loss": 0.125},
                     {"policy": policy})
    # as the pipeline trains: GRPO on that SFT policy named by its run artifact URI (fetched to from-runs/<id>/policy)
    by_uri = f"runs:/{ids['sft']}/policy"
    uri_adapter = shutil.copytree(adapter, root / "uri-adapter")
    fetched = root / "from-runs" / ids["sft"] / "policy"
    (uri_adapter / "adapter_config.json").write_text(json.dumps({**conf, "base_model_name_or_path": str(fetched)}))
    ids["uri_grpo"] = run("grpo", dataclasses.replace(grpo_cfg, model=by_uri, base_adapter=""),
                          {"slmsql.model": by_uri, "slmsql.base_adapter": "", "slmsql.adapter_mode": "none"},
                          summary, {"adapter": uri_adapter})
    ids["uri_eval"] = evaluate("toy-dev", "outputs/grpo/adapter", bird_a, model=by_uri)
    return {"root": root, "adapter": adapter, "ids": ids, "db": root / "template.db"}


def write_json_file(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))


def seed_results() -> dict:
    """Per-question correctness of the sweep's cells, by (variant, eval set, seed), and the baselines."""
    bird_a, bird_b = pairs(50, 4, 5, 90)
    spider_a, spider_b = pairs(160, 6, 4, 30)
    runs = {("defaults", "bird", 0): pairs(50, 6, 5, 88)[0], ("defaults", "bird", 1): bird_a,
            ("defaults", "bird", 2): pairs(50, 3, 5, 91)[0],
            ("defaults", "spider", 0): pairs(160, 5, 4, 31)[0], ("defaults", "spider", 1): spider_a,
            ("defaults", "spider", 2): pairs(160, 7, 4, 29)[0]}
    for seed, k in enumerate((26, 28, 30)):  # binary reward: far better on bird, unchanged on spider
        runs[("runs_tier=0.0 format_tier=0.0", "bird", seed)] = pairs(50, k, 5, 94 - k)[0]
        runs[("runs_tier=0.0 format_tier=0.0", "spider", seed)] = pairs(160, 4 + seed, 4, 32 - seed)[0]
    return {"runs": runs, "baseline": {"bird": bird_b, "spider": spider_b}}


def sweep_report(ids: dict) -> dict:
    """report/sweep.json as `slmsql sweep` writes it, from hand-made per-question results."""
    from slmsql.configs import Variant
    from slmsql.stages import sweep

    data = seed_results()
    variants = [Variant("defaults", {}), Variant("runs_tier=0.0 format_tier=0.0", {"runs_tier": 0.0,
                                                                                   "format_tier": 0.0})]
    plan = sweep.Plan(variants, {}, None, [sweep.EvalSet("bird", "", ""), sweep.EvalSet("spider", "", "")],
                      [0, 1, 2])
    correct = {f"base-{e}": {f"q{i}": c for i, c in enumerate(b)} for e, b in data["baseline"].items()}
    cells = []
    for v in variants:
        for seed in plan.seeds:
            evals = {}
            for e in ("bird", "spider"):
                evals[e] = (ids[f"grpo_{e}"] if (v.label, seed) == ("defaults", 1) else f"{v.label}-{e}-{seed}")
                correct[evals[e]] = {f"q{i}": c for i, c in enumerate(data["runs"][(v.label, e, seed)])}
            cells.append({"variant": v.label, "seed": seed, "eval_runs": evals, "reused": False,
                          "grpo_run": ids["grpo"] if (v.label, seed) == ("defaults", 1) else f"g-{v.label}-{seed}",
                          "baseline_runs": {"bird": "base-bird", "spider": "base-spider"}})
    return sweep.report(plan, cells, correct, alpha=0.05)


@pytest.fixture
def store(world, tmp_path, monkeypatch):
    """This test's own copy of the world's store, at the path conftest pointed MLFLOW_TRACKING_URI to."""
    import os

    import mlflow

    uri = os.environ["MLFLOW_TRACKING_URI"]
    shutil.copy(world["db"], uri.removeprefix("sqlite:///"))
    monkeypatch.chdir(tmp_path)  # the publish run's artifacts land under ./mlruns, inside this test's folder
    mlflow.set_tracking_uri(uri)  # a process-wide setting: an earlier test's store would otherwise win
    yield world["ids"]
    mlflow.set_tracking_uri(None)  # and this test's store must not outlive it (publish sets it too)


@pytest.fixture
def hub(monkeypatch, world):
    size = (world["adapter"] / "adapter_model.safetensors").stat().st_size
    with HubStub(lfs_threshold=size) as stub:  # the weights go LFS, the small JSON files inline
        stub.configure_client(monkeypatch)
        yield stub


def config(ids, tmp_path, evals=("grpo_bird", "grpo_spider"), **kw) -> PublishConfig:
    values = dict(grpo_run=ids["grpo"], eval_runs=",".join(ids[e] for e in evals), filter_run=ids["filter"],
                  repo_id=REPO, output_dir=str(tmp_path / "out"))
    return PublishConfig(**{**values, **kw})


def front_matter(text: str) -> dict:
    return yaml.safe_load(re.match(r"---\n(.*?)\n---\n", text, re.S).group(1))


def section(text: str, title: str) -> str:
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


@pytest.fixture
def loads(monkeypatch):
    """Every model slmsql loads in this process (MLflow's check of an input example loads the logged one)."""
    from slmsql.policy import models

    loaded, load = [], models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loaded.append(a) or load(*a, **k))
    return loaded


@pytest.mark.slow
def test_dry_run_writes_exactly_the_folder(store, world, tmp_path, loads):
    from slmsql.stages.publish import main

    result = main(config(store, tmp_path, dry_run=True))
    assert loads == []  # nothing loaded to check the model: its base may be minutes of Hub retries away offline
    out = tmp_path / "out"
    adapter_files = {p.name for p in world["adapter"].iterdir()}
    assert {p.name for p in out.iterdir()} == adapter_files | {"README.md"} == set(result["files"])
    for name in adapter_files - {"README.md"}:  # the adapter as the GRPO run logged it, byte for byte
        assert (out / name).read_bytes() == (world["adapter"] / name).read_bytes()
    card = (out / "README.md").read_text()
    meta = front_matter(card)
    assert meta["base_model"] == BASE and meta["library_name"] == "peft" and meta["license"] == "apache-2.0"
    results = {r["dataset"]["type"]: r["metrics"][0] for r in meta["model-index"][0]["results"]}
    assert {k: v["value"] for k, v in results.items()} == {"bird": 36.2, "spider": 83.0}
    assert {v["type"] for v in results.values()} == {"execution_accuracy"}
    assert "hub_url" not in result and not (tmp_path / "out.partial").exists()

    import mlflow

    client = mlflow.MlflowClient()
    assert "slmsql.hub_url" not in client.get_run(store["grpo"]).data.tags
    # --dry-run pushes nothing: the written folder is the adapter of a version aliased dry-run (not candidate),
    # tagged as not pushed, its model a LoggedModel of its own
    version = client.get_model_version_by_alias("tiny-grpo", "dry-run")
    assert client.get_registered_model("tiny-grpo").aliases == {"dry-run": version.version}
    assert version.source == result["text2sql_model"] and version.run_id == store["grpo"]
    logged = client.get_logged_model(version.source.removeprefix("models:/"))
    assert logged.name == "text2sql-dry-run" and logged.tags["slmsql.dry_run"] == "true"
    # its page in the UI says what it is, as the policies' do: what it serves, what it wraps, its runs, not pushed
    note = logged.tags["mlflow.note.content"]
    publish_run = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])[0]
    link = lambda run_id: f"/runs/{run_id})"  # noqa: E731  (a Markdown link to the run's page)
    assert note.startswith("The servable `text2sql` MLflow model (pyfunc) that `slmsql publish --dry-run` logged")
    assert "`prompt_style` = compact" in note and "generates greedily" in note
    assert f"It wraps the LoRA adapter that GRPO run [" in note and link(store["grpo"]) in note
    assert "this model's artifact `adapter/`" in note and f"on the base `{BASE}` from the Hugging Face Hub" in note
    assert all(link(store[e]) in note.split("evaluated by ")[1].split(";")[0] for e in ("grpo_bird", "grpo_spider"))
    assert link(store["filter"]) in note.split("filter run ")[1] and link(publish_run.info.run_id) in note
    assert f"Not pushed: a dry run sends nothing to the Hub (a push would go to `{REPO}`)" in note
    assert note.endswith(f"Registered as `tiny-grpo` version {version.version} under the alias `dry-run`.")
    assert {k: version.tags.get(k) for k in ("hub_repo", "pushed", "hub_url", "hub_commit")} == {
        "hub_repo": REPO, "pushed": "no (publish --dry-run)", "hub_url": None, "hub_commit": None}
    local = Path(mlflow.artifacts.download_artifacts(version.source, dst_path=str(tmp_path / "model")))
    meta = mlflow.models.Model.load(str(local))
    pyfunc = meta.flavors["python_function"]
    assert pyfunc["config"]["base_model"] == BASE and pyfunc["config"]["prompt_style"] == "compact"
    assert meta.signature.inputs.input_names() == ["question", "schema", "db_path", "evidence"]
    for name in out.iterdir():
        assert (local / pyfunc["artifacts"]["adapter"]["path"] / name.name).read_bytes() == name.read_bytes()
    publish = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])[0]
    assert publish.data.tags["slmsql.stage"] == "publish" and "hub_new_commit" not in publish.data.metrics
    assert publish.data.tags["mlflow.note.content"] == (
        f"Model card for {REPO} written, not pushed (dry run); registered as tiny-grpo version {version.version} "
        "(@dry-run). "
        f"From GRPO run {store['grpo']} and 2 evaluation run(s).")
    card_artifact = mlflow.artifacts.download_artifacts(run_id=publish.info.run_id, artifact_path="card/README.md",
                                                        dst_path=str(tmp_path / "dl"))
    assert Path(card_artifact).read_text() == card


def test_the_steps_line_says_what_was_planned_and_what_the_time_covers():
    """Steps of max_steps, or in passes over the data (max_steps -1, as the qwen05-spider cells train); a resumed
    run's time is its last attempt's, and the line says for which steps."""
    from slmsql.publishing.card import training_length

    assert training_length({"max_steps": "40"}, {"steps": 40.0, "train_seconds": 9720.0}) == \
        "40 of 40 planned; training time 2 h 42 min"
    one_pass = {"max_steps": "-1", "num_train_epochs": "1.0"}
    assert training_length(one_pass, {"steps": 75.0, "train_seconds": 2670.0, "resumed_at_step": 20.0}) == (
        "75 (1 pass over the RL data); training time 44 min for steps 21-75 (resumed from its step-20 checkpoint; "
        "the time before it is not counted)")
    assert training_length({**one_pass, "num_train_epochs": "2"}, {"steps": 6.0, "train_seconds": 30.0}) == \
        "6 (2 passes over the RL data); training time 30 s"


@pytest.mark.slow
def test_card_states_the_runs_numbers(store, tmp_path):
    from slmsql.stages.publish import main

    main(config(store, tmp_path, dry_run=True))
    card = (tmp_path / "out" / "README.md").read_text()
    results = section(card, "Results")
    bird = next(line for line in results.splitlines() if line.startswith("| bird "))
    assert "36.9%" in bird and "36.2%" in bird and "−0.7" in bird and "no significant difference" in bird
    assert "| 4 / 5 |" in bird  # only GRPO right / only SFT right
    spider = next(line for line in results.splitlines() if line.startswith("| spider "))
    assert "82.0%" in spider and "83.0%" in spider and "+1.0" in spider
    assert f"for the difference, {stats.DIFF_CI_METHOD}." in " ".join(results.split())  # what the runs computed
    details = section(card, "Training details")
    assert "r = 8, alpha = 16" in details and "adapters/sft" in details and "1e-05 (cosine schedule)" in details
    assert "2 h 42 min" in details and "40 of 40 planned" in details
    assert "Advantage gate: correctness (groups whose" in details
    assert "Dynamic sampling: on (groups without correctness variance replaced, up to 3 extra" in details
    signal = section(card, "Training signal")
    assert "| frac_reward_zero_std | 0.12 | 0.05 – 0.2 |" in signal and "| grad_norm | 0.5 | — |" in signal
    assert "| groups with varying correctness | 0.81 |" in signal and "| sampled completions correct | 0.48 |" in signal
    assert "| extra generation rounds per step | 1.5 | — |" in signal
    limits = section(card, "Intended use and limitations")
    assert re.search(r"With n = 149 on bird, differences under \d+\.\d points cannot be reliably detected", limits)
    repro = section(card, "Reproduce")
    assert "slmsql grpo" in repro and "--learning-rate 1e-05" in repro and "--max-steps 40" in repro
    assert "slmsql filter" in repro and repro.count("slmsql evaluate") == 4
    prov = section(card, "Provenance")
    assert all(store[k] in prov for k in ("grpo", "filter", "grpo_bird", "grpo_spider", "sft_bird", "sft_spider"))


def test_verdict_wording_follows_the_statistics(store, tmp_path):
    from slmsql.stages.publish import main

    main(config(store, tmp_path, dry_run=True))
    null = (tmp_path / "out" / "README.md").read_text()
    main(config(store, tmp_path, evals=("better_bird", "grpo_spider"), dry_run=True, overwrite=True))
    mixed = (tmp_path / "out" / "README.md").read_text()
    main(config(store, tmp_path, evals=("better_bird",), dry_run=True, overwrite=True))
    better = (tmp_path / "out" / "README.md").read_text()

    tldr = {name: re.search(r"\*\*TL;DR\.\*\* (.*)", text).group(1) for name, text in
            (("null", null), ("mixed", mixed), ("better", better))}
    assert "does not beat its SFT starting point: a null result" in tldr["null"]
    assert "36.9% → 36.2% (−0.7 points" in tldr["null"] and "could reliably detect" in tldr["null"]
    assert "beats its SFT starting point on bird; on spider the difference is not significant" in tldr["mixed"]
    assert tldr["better"].startswith("This adapter beats its SFT starting point on every evaluated dataset.")
    assert "36.9% → 53.7% (+16.8 points" in tldr["better"]
    assert "null" not in tldr["better"] + tldr["mixed"]
    assert "12% of groups had zero reward variance" in tldr["null"]


def test_every_filter_bucket_is_listed_and_adds_up(store, tmp_path):
    from slmsql.stages.publish import main

    main(config(store, tmp_path, dry_run=True))
    table = section((tmp_path / "out" / "README.md").read_text(), "RL data: pass-rate filter")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("| ")]
    counts = {(name, rate): int(n) for name, rate, n in rows[1:] if name != "**total**"}
    assert counts == {("band", "0.2 < p < 0.8"): 12, ("all fail", "0/8"): 20, ("all pass", "8/8"): 9,
                      ("out of band", "1/8"): 5, ("out of band", "7/8"): 4,
                      ("errors (no database, or gold SQL fails)", "—"): 1}
    assert sum(counts.values()) == FILTER_SUMMARY["n_source"]
    assert "**51** (= 51 questions sampled)" in table


def test_push_makes_one_commit_with_card_and_adapter(store, world, hub, tmp_path, monkeypatch, caplog):
    import mlflow

    from slmsql.stages.publish import main

    monkeypatch.setenv("HF_TOKEN", hub.token)
    caplog.set_level(logging.DEBUG)
    result = main(config(store, tmp_path, endpoint=hub.url, private=True))

    commits = hub.repos[REPO]["commits"]
    assert list(hub.repos) == [REPO] and hub.repos[REPO]["private"] and len(commits) == 1
    assert store["grpo"] in commits[0]["message"] and result["hub_commit"] == commits[0]["oid"]
    out = tmp_path / "out"
    assert hub.files(REPO) == {p.name: p.read_bytes() for p in out.iterdir()}
    meta = front_matter(hub.files(REPO)["README.md"].decode())
    assert [r["metrics"][0]["value"] for r in meta["model-index"][0]["results"]] == [36.2, 83.0]
    commit = next(r for r in hub.requests if r["path"] == f"/api/models/{REPO}/commit/main")
    kinds = {json.loads(line)["value"].get("path"): json.loads(line)["key"] for line in commit["body"].splitlines()}
    assert kinds["adapter_model.safetensors"] == "lfsFile" and kinds["adapter_config.json"] == "file"
    assert kinds["README.md"] == "file" and hub.unhandled == []

    client = mlflow.MlflowClient()
    tags = client.get_run(store["grpo"]).data.tags
    assert tags["slmsql.hub_url"] == f"{hub.url}/{REPO}" and tags["slmsql.hub_commit"] == result["hub_commit"]
    version = client.get_model_version_by_alias("tiny-grpo", "candidate")
    assert version.source == result["text2sql_model"] and version.run_id == store["grpo"]
    assert version.tags["hub_commit"] == result["hub_commit"] and version.tags["hub_repo"] == REPO
    assert version.tags["eval_runs"] == f"{store['grpo_bird']},{store['grpo_spider']}"
    # the version is a text2sql pyfunc logged to the GRPO run: the pushed adapter, a reference to the Hub base
    # (no weights), the evaluations' prompt and generation settings
    logged = client.get_logged_model(version.source.removeprefix("models:/"))
    assert logged.source_run_id == store["grpo"] and logged.name == "text2sql"
    local = Path(mlflow.artifacts.download_artifacts(version.source, dst_path=str(tmp_path / "model")))
    meta = mlflow.models.Model.load(str(local))
    pyfunc = meta.flavors["python_function"]
    assert pyfunc["config"] == {"base_model": BASE, "base_repo": None, "prompt_style": "compact",
                                      "example_values": 0, "max_new_tokens": 128, "batch_size": 16, "decoding": "greedy",
                                      "grpo_run": store["grpo"], "hub_repo": REPO}
    assert pyfunc["artifacts"]["adapter"]["uri"] == "adapter"  # as named in publish's folder, not that folder
    assert set(pyfunc["artifacts"]) == {"adapter"} and meta.signature.inputs.input_names() == \
        ["question", "schema", "db_path", "evidence"] and meta.saved_input_example_info
    for name in out.iterdir():  # the model's adapter is the pushed folder
        assert (local / pyfunc["artifacts"]["adapter"]["path"] / name.name).read_bytes() == name.read_bytes()
    (publish,) = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id],
                                    "tags.`slmsql.stage` = 'publish'")
    assert publish.data.tags["mlflow.note.content"].startswith(
        f"Model card for {REPO} pushed to {hub.url}/{REPO} (commit {result['hub_commit'][:10]}); "
        f"registered as tiny-grpo version {version.version} (@candidate).")

    assert_token_nowhere(hub, (tmp_path, world["root"]), caplog.text)


# ---- which Hub the push goes to: --endpoint, else HF_ENDPOINT --------------------------------------------
# The `hub` fixture points the library's *default* endpoint (huggingface_hub.constants.ENDPOINT) at the stub,
# so the tests above would pass even if publish ignored --endpoint. Here the default is another Hub.

@pytest.fixture
def other_hub():
    """The library's default endpoint in the --endpoint test: a second Hub stand-in, which knows no token the test
    sends, so a push that goes there fails at once (a refused connection instead would cost huggingface_hub's ~23 s
    of retries) and is seen arriving there."""
    with HubStub() as other:
        yield other



def assert_token_nowhere(hub, roots, log_text: str) -> None:
    """The token travels only in the Authorization header: not in any path, query or body; and it is nowhere on
    disk (tracking store, every artifact folder, the pushed folder) nor in the logs."""
    token = hub.token.encode()
    for r in hub.requests:
        assert token not in (r["path"] + "?" + r["query"]).encode() + r["body"]
    for root in roots:
        for path in root.rglob("*"):
            assert not path.is_file() or token not in path.read_bytes(), path
    assert hub.token not in log_text and log_text  # something was logged, and not the token

def cli_args(cfg: PublishConfig) -> list[str]:
    return ["publish", "--grpo-run", cfg.grpo_run, "--eval-runs", ",".join(cfg.eval_runs), "--filter-run", cfg.filter_run,
            "--repo-id", cfg.repo_id, "--output-dir", cfg.output_dir]


def test_endpoint_option_routes_the_push(store, hub, other_hub, tmp_path, monkeypatch):
    import mlflow
    from huggingface_hub import constants

    from slmsql.cli import main

    monkeypatch.setattr(constants, "ENDPOINT", other_hub.url)  # the library default: not the stub `hub`
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        other_hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setenv("HF_TOKEN", hub.token)
    args = cli_args(config(store, tmp_path))

    # without --endpoint the push goes to the default, which refuses the token, and fails (so the stub below is
    # reached only through the option); nothing reached the stub
    failed = CliRunner().invoke(main, args)
    assert failed.exit_code == 2 and f"pushing to {REPO} failed" in failed.output, failed.output
    assert other_hub.requests and other_hub.repos == {}
    assert hub.requests == [] and hub.repos == {}

    result = CliRunner().invoke(main, args + ["--overwrite", "--endpoint", hub.url])
    assert result.exit_code == 0, result.output
    assert len(hub.repos[REPO]["commits"]) == 1 and hub.unhandled == []
    assert hub.files(REPO) == {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    tags = mlflow.MlflowClient().get_run(store["grpo"]).data.tags
    assert tags["slmsql.hub_url"] == f"{hub.url}/{REPO}"


@pytest.mark.slow  # a fresh publish process (~8 s): the fast tier keeps the in-process pushes
def test_hf_endpoint_env_routes_the_push(store, hub, tmp_path):
    """HF_ENDPOINT with no --endpoint. huggingface_hub reads HF_ENDPOINT once, at import, into
    constants.ENDPOINT; setting it in this process (where the library is already imported) would change
    nothing. So publish runs as a fresh subprocess, which imports the library with HF_ENDPOINT set, the one
    way a user's shell sets it. Nothing else in that process names the stub."""
    import mlflow

    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE")}
    env.update(HF_ENDPOINT=hub.url, HF_TOKEN=hub.token, HF_HOME=str(tmp_path / "hf-home"),
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1")  # as hubstub.configure_client, by env
    proc = watched.run([sys.executable, "-m", "slmsql.cli", *cli_args(config(store, tmp_path))], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(hub.repos[REPO]["commits"]) == 1 and hub.unhandled == []
    assert hub.files(REPO) == {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    tags = mlflow.MlflowClient().get_run(store["grpo"]).data.tags
    assert tags["slmsql.hub_url"] == f"{hub.url}/{REPO}"


def test_republishing_is_idempotent(store, hub, tmp_path, monkeypatch):
    import mlflow

    from slmsql.stages.publish import main

    monkeypatch.setenv("HF_TOKEN", hub.token)
    first = main(config(store, tmp_path))
    again = main(config(store, tmp_path, overwrite=True))
    assert first["new_commit"] and not again["new_commit"] and again["hub_commit"] == first["hub_commit"]
    assert list(hub.repos) == [REPO] and len(hub.repos[REPO]["commits"]) == 1
    assert again["model_version"] == first["model_version"] == 1
    assert len(mlflow.MlflowClient().search_model_versions("name='tiny-grpo'")) == 1


def test_no_token_fails_before_any_request(store, hub, tmp_path):
    from slmsql.stages.publish import main

    with pytest.raises(SlmsqlError, match="no Hugging Face token"):
        main(config(store, tmp_path))
    assert hub.requests == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, message", [
    (dict(repo_id="not a repo"), "repo-id"),
    (dict(repo_id="just-a-name"), "OWNER/NAME"),
    (dict(repo_id="a/b/c"), "repo-id"),
    (dict(grpo_run="0" * 32), "does not exist"),
    (dict(grpo_run="filter"), "has stage 'filter', expected 'grpo'"),
    (dict(eval_runs="grpo"), "has stage 'grpo', expected 'evaluate'"),
    (dict(eval_runs="other_base"), "evaluated base model 'other-org/other-model'"),
    (dict(eval_runs="grpo_bird,better_bird"), "one per dataset"),
    (dict(filter_run="sft_bird"), "expected 'filter'"),
    (dict(eval_runs=""), "--eval-runs"),
    (dict(alias="v3"), "reserved"),
    (dict(alias="dry-run"), "--alias dry-run: the alias of dry runs' versions"),
    (dict(sweep_run="filter"), "has stage 'filter', expected 'sweep'"),
    (dict(sweep_run="sweep", grpo_run="local_grpo"), "is not a cell of sweep run"),
    (dict(base_repo="stub-user/tiny-sft"), "is on the Hub already; --base-repo is for a local base"),
    (dict(base_repo=REPO), "--base-repo must differ from --repo-id"),
    (dict(base_repo="not a repo"), "repo-id 'not a repo'"),
])
def test_bad_input_is_refused_before_anything_is_written(store, hub, tmp_path, monkeypatch, change, message):
    import mlflow

    from slmsql.stages.publish import main

    monkeypatch.setenv("HF_TOKEN", hub.token)
    ids = {k: v for k, v in store.items()}
    change = {k: ",".join(ids.get(x, x) for x in v.split(",")) if k.endswith("_run") or k == "eval_runs" else v
              for k, v in change.items()}
    with pytest.raises(SlmsqlError, match=re.escape(message)):
        main(config(store, tmp_path, **change))
    assert hub.requests == [] and not (tmp_path / "out").exists()
    assert mlflow.MlflowClient().get_experiment_by_name("slmsql") is None  # no publish run either


def test_filter_run_of_other_data_is_refused(store, tmp_path, monkeypatch):
    import mlflow

    from slmsql.stages.publish import main

    summary = {**FILTER_SUMMARY, "buckets": {**FILTER_SUMMARY["buckets"], "band": 13, "all_fail": 19}}
    exp = mlflow.create_experiment("other", artifact_location=str(tmp_path / "other"))
    with mlflow.start_run(experiment_id=exp, tags={"slmsql.stage": "filter"}) as run:
        from slmsql.tracking.runs import log_json

        log_json(summary, "summary.json")
    with pytest.raises(SlmsqlError, match="kept 13 band questions, but GRPO run .* trained on 12"):
        main(config(store, tmp_path, filter_run=run.info.run_id, dry_run=True))


@pytest.mark.parametrize("counts, expected", [
    ({"bird": (50, 4, 5, 90), "spider": (160, 6, 4, 30)}, "does not beat its SFT starting point: a null result"),
    ({"bird": (52, 28, 3, 66), "spider": (160, 25, 2, 13)}, "beats its SFT starting point on every evaluated dataset"),
    ({"bird": (52, 3, 28, 66), "spider": (160, 2, 25, 13)}, "is worse than its SFT starting point on every evaluated"),
    ({"bird": (52, 3, 28, 66), "spider": (160, 6, 4, 30)},
     "does not beat its SFT starting point: it is worse on bird and not significantly different on spider"),
    ({"bird": (52, 28, 3, 66), "spider": (160, 2, 25, 13)},
     "Mixed result: this adapter beats its SFT starting point on bird but is worse on spider"),
])
def test_tldr_is_chosen_by_the_verdicts(counts, expected):
    from slmsql.publishing.card import tldr
    from slmsql.stats.wording import pval

    results = []
    for dataset, c in counts.items():
        a, b = pairs(*c)
        results.append({"dataset": dataset, "n": len(a), "ex": sum(a) / len(a), "alpha": 0.05,
                        "cmp": stats.compare(a, b)})
    text = tldr(results, "its SFT starting point", {})
    assert expected in text
    assert ("null result" in text) == (expected.endswith("a null result"))
    for r in results:  # the numbers behind the headline are the comparison's
        assert f"{r['cmp']['ex_b']:.1%} → {r['cmp']['ex_a']:.1%}" in text
        p = r["cmp"]["mcnemar_p"]  # "p < 0.001", or "p = 0.xx": never "p = < 0.001"
        assert (f"McNemar p < 0.001)" if p < 0.001 else f"McNemar p = {pval(p)})") in text
    assert "= <" not in text
    assert "claims no gain" in tldr([{**results[0], "cmp": None}], "its SFT starting point", {})


def test_card_check_refuses_what_the_hub_would_not_read():
    from huggingface_hub import EvalResult, ModelCardData

    from slmsql.stages.publish import check_card

    data = ModelCardData(base_model="a/b", library_name="peft", license="mit", tags=["text-to-sql"], model_name="m",
                         eval_results=[EvalResult(task_type="text-generation", dataset_type="bird", dataset_name="bird",
                                                  metric_type="execution_accuracy", metric_value=36.2)])
    good = f"---\n{data.to_yaml()}\n---\n\n# m\n"
    check_card(good, data)
    bad = {"does not parse": "---\nlicense: [mit\n---\n# m\n",
           "library_name: peft": good.replace("library_name: peft", "library_name: transformers"),
           "base_model": good.replace("base_model: a/b\n", ""),
           "round-trip": good.replace("value: 36.2", "value: 36.3")}
    for message, text in bad.items():
        with pytest.raises(SlmsqlError, match=message):
            check_card(text, data)


def test_grpo_run_without_adapter_is_refused(store, tmp_path):
    import mlflow

    from slmsql.stages.publish import main

    exp = mlflow.create_experiment("other", artifact_location=str(tmp_path / "other"))
    with mlflow.start_run(experiment_id=exp, tags={"slmsql.stage": "grpo", "slmsql.model": BASE}) as run:
        pass
    with pytest.raises(SlmsqlError, match="has no artifact 'adapter'"):
        main(config(store, tmp_path, grpo_run=run.info.run_id, dry_run=True))
    assert not (tmp_path / "out").exists()


def test_hub_base_model():
    from slmsql.inputs.sources import hub_id as hub_base_model

    assert hub_base_model("Qwen/Qwen2.5-Coder-1.5B-Instruct") == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert hub_base_model("/cache/hub/models--Qwen--Qwen2.5-Coder-1.5B/snapshots/abc") == "Qwen/Qwen2.5-Coder-1.5B"
    assert [hub_base_model(p) for p in ("/models/my-sft", "./outputs/sft", "a/b/c", "")] == [None] * 4


@pytest.mark.slow
def test_local_base_model_is_written_but_never_pushed(store, world, hub, tmp_path, monkeypatch, caplog):
    from slmsql.stages.publish import main

    local = dict(grpo_run=store["local_grpo"], eval_runs=store["local_eval"], filter_run="")
    main(config(store, tmp_path, dry_run=True, **local))
    card = (tmp_path / "out" / "README.md").read_text()
    assert front_matter(card)["base_model"] == str(world["root"] / "sft-policy")
    assert "the local checkpoint `" in card and "could be written, not pushed" in caplog.text
    assert "## RL data" not in card and "claims no gain and no loss" in card  # no filter run, no baseline
    # no base a served model could load (no --base-repo names its weights): nothing registered, and said so
    assert "no text2sql model and no registry version" in caplog.text
    import mlflow

    assert mlflow.MlflowClient().search_registered_models() == []
    # with --base-repo (in a process of its own, by the CLI): still no model, as it would have to copy the base, a
    # folder of this machine, into MLflow (the push holds it); nothing sent
    dry = config(store, tmp_path, dry_run=True, base_repo=BASE_REPO, **local)
    proc = watched.run([sys.executable, "-m", "slmsql.cli", *cli_args(dry), "--base-repo", BASE_REPO,
                        "--dry-run", "--overwrite"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no text2sql model and no registry version in a dry run" in proc.stderr
    assert mlflow.MlflowClient().search_registered_models() == []
    assert (tmp_path / "out" / "base" / "README.md").is_file()  # the folder a push would send, written

    assert hub.requests == []
    monkeypatch.setenv("HF_TOKEN", hub.token)
    with pytest.raises(SlmsqlError, match="is a local checkpoint, not a Hub model id: give --base-repo OWNER/NAME"):
        main(config(store, tmp_path, overwrite=True, **local))
    assert hub.requests == []


BASE_REPO = "stub-user/tiny-sft"


@pytest.mark.slow
def test_local_base_is_pushed_with_its_own_card(store, world, hub, tmp_path, monkeypatch, caplog):
    """--base-repo: the local base goes to its own repo first (its own commit and card), the adapter's card and
    adapter_config.json name that repo, and the registered text2sql model holds the base's weights."""
    import mlflow

    from slmsql.stages.publish import main

    monkeypatch.setenv("HF_TOKEN", hub.token)
    caplog.set_level(logging.DEBUG)
    local = dict(grpo_run=store["local_grpo"], eval_runs=store["local_eval"], filter_run="", base_repo=BASE_REPO)
    result = main(config(store, tmp_path, **local))
    out, policy = tmp_path / "out", world["root"] / "sft-policy"

    commits = [r["path"] for r in hub.requests if r["method"] == "POST" and "/commit/" in r["path"]]
    assert commits == [f"/api/models/{BASE_REPO}/commit/main", f"/api/models/{REPO}/commit/main"]  # base first
    assert [len(hub.repos[r]["commits"]) for r in (BASE_REPO, REPO)] == [1, 1] and hub.unhandled == []
    assert REPO in hub.repos[BASE_REPO]["commits"][0]["message"]
    base = hub.files(BASE_REPO)
    assert set(base) == {p.name for p in policy.iterdir()} | {"README.md"}
    assert all(base[p.name] == p.read_bytes() for p in policy.iterdir())  # the checkpoint as it is
    assert base == {p.name: p.read_bytes() for p in (out / "base").iterdir()}
    card = base["README.md"].decode()
    meta = front_matter(card)
    assert meta["base_model"] == BASE and meta["base_model_relation"] == "finetune"
    assert meta["library_name"] == "transformers" and meta["license"] == "apache-2.0"
    assert f"A full fine-tune of [`{BASE}`](https://huggingface.co/{BASE}) by slmsql sft run `{store['sft']}`" in card
    assert "300 steps" in card and f"[`{REPO}`]" in card and str(policy) in card

    adapter = hub.files(REPO)
    assert set(adapter) == {p.name for p in out.iterdir() if p.is_file()}
    assert front_matter(adapter["README.md"].decode())["base_model"] == BASE_REPO
    config_ = json.loads(adapter["adapter_config.json"])
    assert config_["base_model_name_or_path"] == BASE_REPO
    original = json.loads((world["root"] / "local-adapter" / "adapter_config.json").read_text())
    assert config_ == {**original, "base_model_name_or_path": BASE_REPO}

    client = mlflow.MlflowClient()
    tags = client.get_run(store["local_grpo"]).data.tags
    assert tags["slmsql.base_hub_commit"] == result["base_hub_commit"] == hub.repos[BASE_REPO]["commits"][0]["oid"]
    version = client.get_model_version_by_alias("tiny-grpo", "candidate")
    assert version.tags["base_repo"] == BASE_REPO and version.source == result["text2sql_model"]
    model_dir = Path(mlflow.artifacts.download_artifacts(version.source, dst_path=str(tmp_path / "model")))
    pyfunc = mlflow.models.Model.load(str(model_dir)).flavors["python_function"]
    assert pyfunc["config"]["base_model"] is None and pyfunc["config"]["base_repo"] == BASE_REPO
    assert pyfunc["artifacts"]["base"]["path"] == "artifacts/tiny-sft"  # named as the repo: see text2sql.stage_base
    assert all((model_dir / "artifacts/tiny-sft" / p.name).read_bytes() == p.read_bytes() for p in policy.iterdir())

    again = main(config(store, tmp_path, overwrite=True, **local))  # nothing changed: no commit, same version
    assert not again["new_commit"] and not again["base_new_commit"]
    assert [len(hub.repos[r]["commits"]) for r in (BASE_REPO, REPO)] == [1, 1]
    assert again["text2sql_model"] == result["text2sql_model"] and again["model_version"] == result["model_version"]

    assert_token_nowhere(hub, (tmp_path, world["root"]), caplog.text)


def test_cli_dry_run(store, tmp_path):
    from slmsql.cli import main

    cfg = config(store, tmp_path)
    args = ["publish", "--grpo-run", cfg.grpo_run, "--eval-runs", ",".join(cfg.eval_runs), "--filter-run", cfg.filter_run,
            "--repo-id", REPO, "--output-dir", cfg.output_dir, "--license", "mit", "--dry-run"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert front_matter((tmp_path / "out" / "README.md").read_text())["license"] == "mit"
    bad = CliRunner().invoke(main, [a if a != REPO else "no/such/repo" for a in args[:-1]] + ["--overwrite"])
    assert bad.exit_code == 2 and "error: --repo-id 'no/such/repo'" in bad.output


def test_config_holds_no_token_field():
    names = {f.name for f in dataclasses.fields(PublishConfig)}
    assert not {n for n in names if "token" in n}


# ---- seeds: a card from one seed says so; a card with its sweep states the pooled verdict ------------------

def test_single_seed_card_says_what_one_seed_cannot_tell(store, tmp_path):
    from slmsql.publishing.card import SINGLE_SEED
    from slmsql.stages.publish import main

    main(config(store, tmp_path, dry_run=True))
    card = (tmp_path / "out" / "README.md").read_text()
    tldr = re.search(r"\*\*TL;DR\.\*\* (.*)", card).group(1)
    assert tldr.endswith(SINGLE_SEED) and "one training seed" in SINGLE_SEED and SINGLE_SEED.count(". ") == 0
    assert "## Seeds and variants" not in card


def test_sweep_card_carries_the_table_and_the_pooled_verdict(store, tmp_path):
    import numpy as np
    from scipy import stats as scipy_stats

    from slmsql.publishing.card import SINGLE_SEED
    from slmsql.stages.publish import main

    # no --eval-runs: the cell's own evaluations
    main(config(store, tmp_path, evals=(), sweep_run=store["sweep"], dry_run=True))
    card = (tmp_path / "out" / "README.md").read_text()
    tldr = re.search(r"\*\*TL;DR\.\*\* (.*)", card).group(1)
    assert SINGLE_SEED not in card
    assert tldr.startswith("Pooled over 3 training seeds, this variant (`defaults`) does not beat its SFT starting "
                           "point: a null result")
    data = seed_results()
    for dataset in ("bird", "spider"):  # the pooled numbers, computed here independently
        seeds = np.array([data["runs"][("defaults", dataset, s)] for s in (0, 1, 2)], dtype=float)
        base = np.array(data["baseline"][dataset], dtype=float)
        ex = seeds.mean(axis=1)
        p = scipy_stats.ttest_1samp(seeds.mean(axis=0) - base, 0).pvalue
        assert (f"{dataset}: {base.mean():.1%} → {ex.mean():.1%} mean over seeds (between seeds: sd "
                f"{100 * ex.std(ddof=1):.1f} points, {100 * ex.min():.1f}%–{100 * ex.max():.1f}%") in tldr
        assert f"p = {p:.2f}" in tldr
    assert "Holm-adjusted p = " in tldr and "over 4 comparisons" in tldr
    assert "This adapter (seed 1) alone: bird: 36.9% → 36.2%" in tldr  # its own single-seed numbers follow
    table = section(card, "Seeds and variants")
    assert "seed 1 of the GRPO variant `defaults`, one of 2 variants × 3" in " ".join(table.split())
    rows = [line for line in table.splitlines() if line.startswith("| ") and "sd of the per-seed differences" not in line]
    # per eval set: the pooled table (a header and one row per variant), then the same rows over seeds
    method_rows = [line for line in rows if line.count("|") == 7 and not line.startswith("| Variant")]
    rows = [line for line in rows if line not in method_rows]
    assert len(rows) == 2 * (1 + 2) and len(method_rows) == 2 * 2
    assert table.count("Over seeds (the seeds a random unit too") == 2
    for dataset in ("bird", "spider"):  # the method's interval: seedstats.over_seeds on the same questions
        from slmsql.stats.seedstats import over_seeds
        r = over_seeds([data["runs"][("defaults", dataset, s)] for s in (0, 1, 2)], data["baseline"][dataset])
        cell = f"[{100 * r['diff_ci_low']:+.1f}, {100 * r['diff_ci_high']:+.1f}]".replace("-", "−")
        assert any(line.startswith("| **defaults** (this adapter's)") and cell in line for line in method_rows)
    better = next(line for line in rows if line.startswith("| runs_tier=0.0 format_tier=0.0 |") and "improved" in line)
    bird_binary = np.array([data["runs"][("runs_tier=0.0 format_tier=0.0", "bird", s)] for s in (0, 1, 2)]).mean(1)
    assert f"| {100 * bird_binary.mean():.1f}% | {100 * bird_binary.std(ddof=1):.1f} |" in better
    assert sum("**defaults** (this adapter's)" in line for line in rows) == 2
    assert store["sweep"] in section(card, "Provenance") and "slmsql sweep" in section(card, "Reproduce")
    assert f"--eval-runs {store['grpo_bird']},{store['grpo_spider']}" in section(card, "Reproduce")
    # the same results as a card given the eval runs explicitly
    assert front_matter(card)["model-index"][0]["results"][0]["metrics"][0]["value"] == 36.2


def test_sweep_card_of_several_starts_shows_each_rows_start(store, tmp_path):
    """A sweep with a start axis: the card's table has a Start EX column (each row vs its own start), and no
    single start's EX heads it."""
    import mlflow

    from slmsql.configs import Variant
    from slmsql.stages import sweep
    from slmsql.stages.publish import main

    data = seed_results()
    starts = [sweep.Start("weak", "w", "", "bw"), sweep.Start("demo", "d", "", "bd")]
    variants = [Variant(f"start={s.name} defaults", {}) for s in starts]
    plan = sweep.Plan(variants, {}, None, [sweep.EvalSet("bird", "", ""), sweep.EvalSet("spider", "", "")],
                      [0, 1, 2], starts, dict(zip([v.label for v in variants], starts)))
    # the demo start's baseline is the weak start's results shifted: a different start EX per row
    correct = {f"base-{s.name}-{e}": {f"q{i}": (c if s.name == "weak" else not c) for i, c in enumerate(b)}
               for s in starts for e, b in data["baseline"].items()}
    cells = []
    for v, s in zip(variants, starts):
        for seed in plan.seeds:
            evals = {}
            for e in ("bird", "spider"):
                mine = s.name == "weak" and seed == 1
                evals[e] = store[f"grpo_{e}"] if mine else f"{s.name}-{e}-{seed}"
                correct[evals[e]] = {f"q{i}": c for i, c in enumerate(data["runs"][("defaults", e, seed)])}
            cells.append({"variant": v.label, "seed": seed, "eval_runs": evals, "reused": False,
                          "grpo_run": store["grpo"] if (s.name, seed) == ("weak", 1) else f"g-{s.name}-{seed}",
                          "baseline_runs": {e: f"base-{s.name}-{e}" for e in ("bird", "spider")}})
    rep = sweep.report(plan, cells, correct, alpha=0.05)
    client = mlflow.MlflowClient()
    run = client.create_run(client.get_run(store["grpo"]).info.experiment_id, tags={"slmsql.stage": "sweep"})
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "sweep.json").write_text(json.dumps(rep))
    client.log_artifacts(run.info.run_id, str(tmp_path / "report"), "report")
    client.set_terminated(run.info.run_id)

    main(config(store, tmp_path, evals=(), sweep_run=run.info.run_id, dry_run=True))
    table = " ".join(section((tmp_path / "out" / "README.md").read_text(), "Seeds and variants").split())
    assert "from each of 2 starting points (weak, demo), each on its own RL data" in table
    assert "| Variant | Start EX | EX mean |" in table and "; the SFT" not in table.split("| Variant")[0]
    for r in rep["rows"]:  # every row shows its own start's EX
        assert f"{r['variant']}{'** (this adapter' if r['variant'].startswith('start=weak') else ''}" in table
    weak = next(r for r in rep["rows"] if r["variant"] == "start=weak defaults" and r["eval_set"] == "bird")
    demo = next(r for r in rep["rows"] if r["variant"] == "start=demo defaults" and r["eval_set"] == "bird")
    assert weak["ex_b"] != demo["ex_b"]
    assert f"| {100 * demo['ex_b']:.1f}% | {100 * demo['ex_mean']:.1f}% |" in table


# ---- a study: the card of one of its cells says what transferred, from the study's report.json -------------------

STUDY_YAML = """\
question: Do the reward sets transfer to held-out sets?
title: a hand-built study
experiment: inputs
start: {model: slmsql-test/tiny-qwen2, adapter: adapters/sft}
band: {limit: 0}
db_root: dbs
grpo: {max_steps: 40}
arms:
  outcome: {}
  dense: {learning_rate: 3.0e-4}
  qatch: {learning_rate: 1.0e-4}
seeds: [0, 1, 2]
eval_sets:
  - {name: bird, data: data/bird.jsonl}
  - {name: spider, data: data/spider.jsonl}
"""


def hand_built_study(root: Path, ids: dict, as_run: bool = False, declared: str = "") -> Path:
    """A study folder as `slmsql study run` leaves it, its records made here from the sweep's hand-made results (no
    training): outcome is the sweep's `defaults` (null on both sets; its seed 1 is the world's GRPO run, evaluated
    by grpo_bird / grpo_spider), dense its binary-reward variant (far better on bird), qatch lacks seed 2's record
    (no verdict). outcome's records carry a diagnosis, dense's and qatch's are older ones, without. Its report
    is written by `slmsql study report`'s own code. `as_run`: the records name runs as `study run` makes them: the
    start's evaluations (sft_bird / sft_spider) and filter, and seed 1 evaluated alone (alone_bird / alone_spider).
    `declared`: more of study.yaml (its comparisons; by default each arm against the start)."""
    from slmsql.configs import StudyReportConfig
    from slmsql.stages import study as study_stage
    from slmsql.studies import diagnosis, records, spec

    folder = root / "studies" / "handmade"
    folder.mkdir(parents=True)
    (folder / "study.yaml").write_text(STUDY_YAML + declared)
    study = spec.load(folder)
    data = seed_results()
    as_results = lambda by_set: {es: {f"q{i}": [bool(c), "0" * 16] for i, c in enumerate(v)}  # noqa: E731
                                 for es, v in by_set.items()}
    records.write(study, records.make(study, records.START, config=study.start_config(), start={"fingerprint": "f0"},
                                      code_version="c0de", results=as_results(data["baseline"]), metrics={},
                                      runs={"eval_runs": {es: ids[f"sft_{es}"] for es in ("bird", "spider")},
                                            "filter_run": ids["filter"]} if as_run else {}))
    evals = "alone" if as_run else "grpo"
    like = {"outcome": "defaults", "dense": "runs_tier=0.0 format_tier=0.0", "qatch": "defaults"}
    for c in study.cells():
        if c.id == "qatch-seed2":
            continue
        mine = c.id == "outcome-seed1"
        runs = {"grpo_run": ids["grpo"] if mine else f"g-{c.id}",
                "eval_runs": {es: ids[f"{evals}_{es}"] if mine else f"e-{c.id}-{es}" for es in ("bird", "spider")}}
        why = {**dict.fromkeys(diagnosis.KEYS), "logged_steps": 40, "pass_first10": 0.2, "pass_last10": 0.6,
               "zero_std": 0.5, "draws_min": 3, "draws_max": 3} if c.arm == "outcome" else None
        records.write(study, records.make(
            study, c.id, config=study.cell_config(c), start={"fingerprint": "f0"}, code_version="c0de",
            results=as_results({es: data["runs"][(like[c.arm], es, c.seed)] for es in ("bird", "spider")}),
            metrics={}, runs=runs, arm=c.arm, seed=c.seed, diagnosis=why))
    study_stage.report(StudyReportConfig(study=str(folder)))
    return folder


@pytest.mark.slow
def test_a_study_cells_card_states_what_transferred_and_what_did_not(store, tmp_path):
    from slmsql.stages.publish import main
    from slmsql.stats.wording import pts

    folder = hand_built_study(tmp_path, store)
    rep = json.loads((folder / "report.json").read_text())
    main(config(store, tmp_path, evals=(), study=str(folder), dry_run=True))  # the cell's evaluations by default
    card = (tmp_path / "out" / "README.md").read_text()
    results, tldr = section(card, "Results"), re.search(r"\*\*TL;DR\.\*\* (.*)", card).group(1)
    row = {(r["label"], r["eval_set"]): r for r in rep["rows"]}
    dense, outcome = row[("dense vs start", "bird")], row[("outcome vs start", "bird")]
    assert (dense["verdict"], outcome["verdict"], row[("qatch vs start", "bird")]["verdict"]) == (
        "improved", "no significant difference", None)
    assert tldr.startswith("This adapter is seed 1 of arm `outcome` of the study `handmade` (8 of 9 cells "
                           "recorded). Transferred (a significant gain after Holm's adjustment over the 6 declared "
                           "comparisons, for the seeds trained): `dense vs start` on bird. Not transferred: "
                           "`outcome vs start` on bird (no significant difference); ")
    assert "No verdict: `qatch vs start` on bird (records missing: qatch-seed2)" in tldr
    assert "This adapter alone: bird: 36.9% → 36.2%" in tldr  # its own evaluations, from the record
    # in the results, the null comparison (this adapter's own arm) stated as not transferred, with its numbers
    said = (f"`outcome vs start` on bird: no significant difference ({pts(outcome['diff'])} points, 95% CI "
            f"[{pts(outcome['diff_ci_low'])}, {pts(outcome['diff_ci_high'])}], p (Holm) = 1.00; over seeds, for the "
            "method: no significant difference)")
    words = next(line for line in results.splitlines() if line.startswith("Transferred ("))
    assert f"`dense vs start` on bird ({pts(dense['diff'])} points" in words.split("Not transferred:")[0]
    assert f"Not transferred: {said}" in words and "Transferred (" not in words.split("Not transferred:")[1]
    lines = {tuple(x.strip() for x in line.split("|")[1:3]): line for line in results.splitlines()
             if line.startswith("| ") and "vs start" in line}
    assert len(lines) == 6
    assert lines[("outcome vs start", "bird")].endswith("| no significant difference | not transferred |")
    # pooled "improved" makes it "transferred"; over seeds (t on 2 df) the method's verdict is the report's own
    assert "| < 0.001 | improved | " in lines[("dense vs start", "bird")]
    assert lines[("dense vs start", "bird")].endswith(f"| {dense['seed_verdict']} | transferred |")
    assert lines[("dense vs start", "spider")].endswith("| not transferred |")
    assert lines[("qatch vs start", "spider")].endswith("| n/a | no verdict | no verdict |")  # p (Holm): none
    over = f"[{pts(dense['seed_diff_ci_low'])}, {pts(dense['seed_diff_ci_high'])}]"  # the method's interval
    assert f"| {pts(dense['diff'])} [{pts(dense['diff_ci_low'])}, {pts(dense['diff_ci_high'])}] |" in \
        lines[("dense vs start", "bird")] and over in lines[("dense vs start", "bird")]
    # the diagnosis beside it, as the study's report prints it
    report_md = (folder / "report.md").read_text()
    diag = [line for line in results.splitlines() if line.startswith(("| outcome |", "| dense |", "| qatch |"))]
    assert diag and all(f"{line}\n" in report_md for line in diag)
    assert diag[0].startswith("| outcome | 0, 1, 2 | 0.20 -> 0.60 | n/a | 50% | n/a | n/a | n/a | n/a | 3-3 |")
    assert diag[1].startswith("| outcome | seed 0 | 0.20 -> 0.60 | n/a | 50% | n/a | n/a | n/a | n/a | 3-3 |")  # then each seed's
    assert diag[4].startswith("| dense | 0, 1, 2 | not recorded |")
    assert f"slmsql study run {folder}" in section(card, "Reproduce")
    assert f"--study {folder}" in section(card, "Reproduce")
    assert f"--eval-runs {store['grpo_bird']},{store['grpo_spider']}" in section(card, "Reproduce")
    assert f"`{folder}`" in section(card, "Provenance")


@pytest.mark.slow
def test_an_arm_against_an_arm_is_said_as_better_or_not_not_as_transferred(store, tmp_path):
    """Against another arm the question is whether this arm transferred better, not whether it transferred: the
    card says "better than ARM" / "not better than ARM" there, and "transferred" only of comparisons with the
    start."""
    from slmsql.stages.publish import main

    folder = hand_built_study(tmp_path, store, declared=(
        "comparisons:\n  - {arm: outcome}\n  - {arm: dense, against: outcome}\n  - {arm: qatch, against: outcome}\n"))
    rep = json.loads((folder / "report.json").read_text())
    verdicts = {(r["label"], r["eval_set"]): r["verdict"] for r in rep["rows"]}
    assert (verdicts[("dense vs outcome", "bird")], verdicts[("dense vs outcome", "spider")],
            verdicts[("outcome vs start", "bird")]) == ("improved", "no significant difference",
                                                         "no significant difference")
    main(config(store, tmp_path, evals=(), study=str(folder), dry_run=True))
    card = (tmp_path / "out" / "README.md").read_text()
    tldr = re.search(r"\*\*TL;DR\.\*\* (.*)", card).group(1)
    assert ("Nothing transferred: no comparison with the start is a significant gain after Holm's adjustment over "
            "the 6 declared comparisons. Not transferred: `outcome vs start` on bird (no significant difference); "
            "`outcome vs start` on spider (") in tldr
    assert ("Better than `outcome` (a significant gain after Holm's adjustment over the 6 declared comparisons, for "
            "the seeds trained): `dense vs outcome` on bird. Not better than `outcome`: `dense vs outcome` on spider "
            "(no significant difference).") in tldr
    assert "`dense vs outcome` on spider" not in tldr.split("Not better than")[0]  # never "not transferred"
    lines = {tuple(x.strip() for x in line.split("|")[1:3]): line for line in section(card, "Results").splitlines()
             if line.startswith("| ") and " vs " in line}
    # pooled "improved" makes it "better than"; over seeds (t on seeds - 1 df) the method's verdict stands beside it
    assert "| < 0.001 | improved | " in lines[("dense vs outcome", "bird")]
    assert lines[("dense vs outcome", "bird")].endswith("| better than outcome |")
    assert lines[("dense vs outcome", "spider")].endswith("| not better than outcome |")
    assert lines[("outcome vs start", "bird")].endswith("| not transferred |")
    assert lines[("qatch vs outcome", "bird")].endswith("| no verdict |")


@pytest.mark.slow
def test_a_study_cells_card_compares_each_evaluation_with_the_starts(store, tmp_path):
    """A study's cells are evaluated without a baseline; the card pairs each with the start's evaluation of that
    set (from the records), as an evaluation run against it would have, and takes the start's filter run."""
    from slmsql.stages.publish import main

    folder = hand_built_study(tmp_path, store, as_run=True)
    main(config(store, tmp_path, evals=(), filter_run="", study=str(folder), dry_run=True))
    card = (tmp_path / "out" / "README.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in section(card, "Results").splitlines()
            if line.startswith(("| bird |", "| spider |"))}
    # the world's pairs: bird 50 both right, 4 only GRPO, 5 only the start (of 149); spider 160 / 6 / 4 (of 200)
    assert "| 4 / 5 |" in rows["bird"] and "| 6 / 4 |" in rows["spider"]
    assert "| 36.9% [" in rows["bird"] and "| 36.2% [" in rows["bird"]  # 55/149 the start's, 54/149 this cell's
    verdicts = {es: line.split("|")[9].strip() for es, line in rows.items()}
    assert verdicts == dict.fromkeys(("bird", "spider"), "no significant difference (α = 0.05)")
    # the same table as the card of the evaluations run against the start's (evaluate's own comparison)
    main(config(store, tmp_path, evals=("grpo_bird", "grpo_spider"), output_dir=str(tmp_path / "paired"),
                dry_run=True))
    paired = (tmp_path / "paired" / "README.md").read_text()
    assert all(line in section(paired, "Results").splitlines() for line in rows.values())
    # the start's filter run, without --filter-run
    assert "| band |" in section(card, "RL data: pass-rate filter")
    for run in ("sft_bird", "sft_spider", "filter"):  # cited, and in the reproduce commands
        assert store[run] in section(card, "Provenance")


@pytest.mark.slow
def test_a_study_cell_publishes_where_the_starts_runs_are_not(store, tmp_path, caplog):
    """Studies run anywhere: the machine publishing a cell may not hold the start's runs (its records name them).
    The card's comparison with the start then comes from the records alone; what needs the runs themselves (the
    filter's table, the start's reproduce commands) is left out, with a warning naming the run and the record. A
    --filter-run given by hand is still refused when it does not exist."""
    from slmsql.stages.publish import main

    gone = {"sft_bird": "a" * 32, "sft_spider": "b" * 32, "filter": "c" * 32}  # runs of another machine's store
    folder = hand_built_study(tmp_path, {**store, **gone}, as_run=True)
    with caplog.at_level(logging.WARNING, logger="slmsql.stages.publish"):
        main(config(store, tmp_path, evals=(), filter_run="", study=str(folder), dry_run=True))
    card = (tmp_path / "out" / "README.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in section(card, "Results").splitlines()
            if line.startswith(("| bird |", "| spider |"))}
    assert "| 4 / 5 |" in rows["bird"] and "| 6 / 4 |" in rows["spider"]  # the records' pairs, as with the runs
    assert "| The study's start: EX [95% CI] |" in section(card, "Results")  # what the records know it as
    assert "| 36.9% [" in rows["bird"] and "| 36.2% [" in rows["bird"]
    assert "## RL data: pass-rate filter" not in card and "evaluate the starting point" not in card
    said = " ".join(r.getMessage() for r in caplog.records)
    for run in gone.values():
        assert f"run {run} ({folder}/records/start.json) is not in" in said
    with pytest.raises(SlmsqlError, match=f"filter run '{gone['filter']}' does not exist"):
        main(config(store, tmp_path, evals=(), filter_run=gone["filter"], study=str(folder), dry_run=True,
                    output_dir=str(tmp_path / "again")))
    assert not (tmp_path / "again").exists()


@pytest.mark.slow
def test_a_study_whose_report_is_stale_or_given_with_a_sweep_is_refused(store, tmp_path):
    from slmsql.stages.publish import main

    folder = hand_built_study(tmp_path, store)
    with pytest.raises(SlmsqlError, match="give --study or --sweep-run, not both"):
        main(config(store, tmp_path, evals=(), study=str(folder), sweep_run=store["sweep"], dry_run=True))
    path = folder / "records" / "dense-seed0.json"  # a record changed after the report was written
    rec = json.loads(path.read_text())
    path.write_text(json.dumps({**rec, "finished_at": "2027-01-01T00:00:00Z"}))  # provenance is in report.json
    with pytest.raises(SlmsqlError, match=re.escape(f"{folder / 'report.json'}: not the report the study's records "
                                                    f"give now: run `slmsql study report {folder}` first")):
        main(config(store, tmp_path, evals=(), study=str(folder), dry_run=True))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_run_that_is_no_cell_of_the_study_is_refused_from_the_command_line(store, tmp_path):
    folder = hand_built_study(tmp_path, store)
    proc = watched.run([sys.executable, "-m", "slmsql.cli", "publish", "--grpo-run", store["local_grpo"],
                        "--study", str(folder), "--repo-id", REPO, "--output-dir", str(tmp_path / "out"),
                        "--dry-run"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"error: {folder / 'records'}: GRPO run {store['local_grpo']} is not a cell of study handmade: none of "
            "its 8 cell records names it") in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_reproduce_command_prints_only_what_differs_from_the_defaults():
    """Params come back from MLflow as text: a default logged as 'false' (or 'False', by an older slmsql) or
    'all-linear' is not printed, a changed value is, quoted for the shell."""
    from slmsql.publishing.card import command

    params = {"dynamic_sampling": "False", "target_modules": "all-linear", "use_lora": "true", "max_steps": "40",
              "reward_weights": "", "data": "my band.jsonl", "trainer_args.warmup_ratio": "0.1",
              "output_dir": "/home/me/outputs/grpo"}  # where it wrote: not a machine path on the card
    lines = command("grpo", params).split(" \\\n    ")
    assert lines[0] == "slmsql grpo"
    assert sorted(lines[1:]) == ["--data 'my band.jsonl'", "--max-steps 40", "--trainer-args warmup_ratio=0.1"]


def test_dry_run_names_a_base_that_is_a_run_artifact_and_copies_none(store, world, tmp_path, loads):
    """As `make demo` runs it: the GRPO run's base is the SFT run's artifact (runs:/<sft run>/policy) and
    --base-repo names where a push would put it. The dry run's model names that artifact, holds none of its weights,
    and, loaded by its alias, fetches it and answers (the adapter's base is the repo's name, as pushed)."""
    import mlflow
    import pandas as pd

    from slmsql.stages.publish import main

    result = main(config(store, tmp_path, grpo_run=store["uri_grpo"], eval_runs=store["uri_eval"], filter_run="",
                         base_repo=BASE_REPO, dry_run=True))
    assert loads == []
    client = mlflow.MlflowClient()
    version = client.get_model_version_by_alias("tiny-grpo", "dry-run")
    assert version.source == result["text2sql_model"] and version.tags["base_repo"] == BASE_REPO
    model_dir = Path(mlflow.artifacts.download_artifacts(version.source, dst_path=str(tmp_path / "model")))
    pyfunc = mlflow.models.Model.load(str(model_dir)).flavors["python_function"]
    assert set(pyfunc["artifacts"]) == {"adapter"} and not (model_dir / "artifacts" / "tiny-sft").exists()
    assert pyfunc["config"]["base_uri"] == f"runs:/{store['sft']}/policy" and pyfunc["config"]["base_model"] is None
    note = client.get_logged_model(version.source.removeprefix("models:/")).tags["mlflow.note.content"]
    assert (f"on the base the run artifact `runs:/{store['sft']}/policy`, fetched when the model loads (not copied "
            f"here); a push would send it to `{BASE_REPO}`.") in note
    assert "Not pushed" in note and "filter run" not in note  # none given
    weights = {p.name for p in (world["root"] / "sft-policy").glob("*.safetensors")}
    assert weights and not any(p.name in weights for p in model_dir.rglob("*.safetensors"))
    served = mlflow.pyfunc.load_model("models:/tiny-grpo@dry-run").predict(pd.DataFrame(
        [{"question": "How many items cost more than 2?", "schema": "CREATE TABLE item (id INTEGER, price REAL)"}]))
    assert list(served.columns) == ["sql", "completion"] and len(served) == 1
    assert [Path(a[0]).name for a in loads] == ["tiny-sft"]  # the fetched base, named as the pushed repo


def test_a_dry_run_takes_nothing_a_push_made(store, hub, tmp_path, monkeypatch):
    """Dry run, push, dry run, on a GRPO run with its policy's LoggedModel (as `slmsql grpo` makes it), which holds
    the EX of its evaluations. The push fills that model and takes --alias (candidate): run -> policy model (with
    its EX) -> registered version. Neither dry run takes the policy's model or the alias; each gets its own model
    and the alias dry-run (the second reuses the first's)."""
    import mlflow
    from mlflow.entities import LoggedModelStatus

    from slmsql.tracking import lineage
    from slmsql.stages.publish import main

    client = mlflow.MlflowClient()
    policy = lineage.start_policy_model(store["grpo"], "grpo", "adapter")
    client.finalize_logged_model(policy, LoggedModelStatus.READY)
    for name, dataset in (("grpo_bird", "bird"), ("grpo_spider", "spider")):  # as evaluate logs EX to the model
        ex = client.get_run(store[name]).data.metrics["ex"]
        client.log_metric(store[name], "ex", ex, model_id=policy, dataset_name=dataset, dataset_digest="d" + dataset)
    ex = {m.dataset_name: m.value for m in client.get_logged_model(policy).metrics if m.key == "ex"}

    first = main(config(store, tmp_path, dry_run=True))
    assert first["text2sql_model"] != f"models:/{policy}" and first["alias"] == "dry-run"
    assert "slmsql.fingerprint" not in client.get_logged_model(policy).tags  # the policy's model: untouched

    monkeypatch.setenv("HF_TOKEN", hub.token)
    pushed = main(config(store, tmp_path, overwrite=True))
    assert pushed["text2sql_model"] == f"models:/{policy}" and pushed["alias"] == "candidate"
    candidate = client.get_model_version_by_alias("tiny-grpo", "candidate")
    assert candidate.source == f"models:/{policy}" and candidate.run_id == store["grpo"]
    assert client.get_run(store["grpo"]).data.tags[lineage.MODEL_TAG] == policy
    model = client.get_logged_model(policy)
    assert {m.dataset_name: m.value for m in model.metrics if m.key == "ex"} == ex == {
        "bird": pytest.approx(54 / 149), "spider": pytest.approx(166 / 200)}
    assert "MLmodel" in {f.path for f in client.list_logged_model_artifacts(policy)}
    # the policy's page stays the policy's (lineage.describe_model), the dry run's says it was not pushed
    assert "Not pushed" in client.get_logged_model(first["text2sql_model"].removeprefix("models:/")).tags[
        "mlflow.note.content"]
    assert "servable" not in client.get_logged_model(policy).tags.get("mlflow.note.content", "").split(".")[0]

    second = main(config(store, tmp_path, dry_run=True, overwrite=True))
    assert second["text2sql_model"] == first["text2sql_model"] and second["model_version"] == first["model_version"]
    aliases = client.get_registered_model("tiny-grpo").aliases
    assert {k: int(v) for k, v in aliases.items()} == {"candidate": int(candidate.version),
                                                        "dry-run": first["model_version"]}
    assert client.get_model_version("tiny-grpo", candidate.version).tags["hub_commit"] == pushed["hub_commit"]


def test_cli_help_says_what_a_dry_run_does():
    proc = watched.run([sys.executable, "-m", "slmsql.cli", "publish", "--help"], env={**os.environ, "COLUMNS": "300"})
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "push nothing;" not in text.lower()
    for words in ("Push nothing to the Hub", "a LoggedModel of its own (never the GRPO policy's",
                  "the alias 'dry-run' (never --alias)", "not loaded to check it", "no local base is copied into "
                  "MLflow", "Registry alias for the pushed version (a dry run's takes 'dry-run')"):
        assert words in text, words


# ---- an installed wheel (not editable), outside a checkout -------------------------------------------------------

@pytest.mark.slow  # builds the wheel and installs it (~30 s)
def test_an_installed_wheel_validates_and_publishes_outside_a_checkout(store, tmp_path):
    """`pip wheel .`, the wheel installed with --no-deps --target into a folder of its own and run from another:
    the card's templates and the data-check suites travel in it (found with importlib.resources, no
    SLMSQL_DATA_CHECKS), and `pipeline`, which runs a checkout's MLproject, says so before any run or output."""
    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "checkout"  # the tracked tree, so that the build writes nothing into the real one
    shutil.copytree(root, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".cache", "outputs", "mlruns", "site", "mlflow.db", "__pycache__", "*.egg-info", "build"))
    # without build isolation (no index needed) the build runs on this environment's setuptools: the one the
    # build-system table asks for (the test extra installs it; a Python 3.11 venv brings 65.5, which cannot)
    from importlib.metadata import version

    from packaging.requirements import Requirement

    for req in map(Requirement, tomllib.loads((root / "pyproject.toml").read_text())["build-system"]["requires"]):
        assert req.specifier.contains(version(req.name), prereleases=True), \
            f"{req.name} {version(req.name)} installed; the build needs {req} (pip install -e '.[test]')"
    pip = [sys.executable, "-m", "pip", "-q"]
    done = watched.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(src), "-w", str(tmp_path / "dist")])
    assert done.returncode == 0, done.stderr[-3000:]
    wheel, = (tmp_path / "dist").glob("slmsql-*.whl")
    site = tmp_path / "site"
    done = watched.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)])
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("model_card/README.md.j2", "model_card/base.md.j2", "data_checks/rl.json", "data_checks/eval.json"):
        assert (site / "slmsql" / name).is_file() and not (site / "slmsql" / name).is_symlink(), name

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k != "SLMSQL_DATA_CHECKS"}, "PYTHONPATH": str(site)}

    def slmsql(*args):
        return watched.run([sys.executable, "-m", "slmsql.cli", *args], cwd=elsewhere, env=env)

    where = watched.run([sys.executable, "-c", "import slmsql; print(slmsql.__file__)"], cwd=elsewhere, env=env)
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr  # the wheel, not the checkout
    assert slmsql("toy", "--output-dir", "toy").returncode == 0
    done = slmsql("validate", "--kind", "eval", "--data", "toy/dev.jsonl", "--db-root", "toy/databases",
                  "--output-dir", "checks")
    assert done.returncode == 0, done.stderr[-3000:]
    done = slmsql(*cli_args(config(store, tmp_path)), "--dry-run")
    assert done.returncode == 0, done.stderr[-3000:]
    card = (tmp_path / "out" / "README.md").read_text()
    assert front_matter(card)["base_model"] == BASE and "## " in card  # rendered from the wheel's template
    import mlflow

    client = mlflow.MlflowClient()

    def runs() -> int:
        return len(client.search_runs([e.experiment_id for e in client.search_experiments()]))

    before = runs()
    done = slmsql("pipeline", "--output-dir", "pipe")
    assert done.returncode == 2 and "from a checkout of slmsql" in done.stderr and "Traceback" not in done.stderr
    assert not (elsewhere / "pipe").exists() and runs() == before  # refused before any output or run
