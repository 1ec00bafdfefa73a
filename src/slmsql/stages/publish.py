"""Publish: a Hugging Face model card generated from the MLflow runs, pushed with the LoRA adapter in one commit.

args (repo id, registry name, token) -> runs (exist, finished, right stage, one base model) -> card -> card check
-> OUT/ (exactly what is pushed: the adapter files + README.md) -> Hub: create_repo + one upload_folder commit
-> Hub URL and commit back on the GRPO run -> an MLflow Model Registry version with an alias.

Nothing is written, logged or sent before every check passes. The token lives in a local variable and the HfApi
client only: the config has no field for it, so it cannot reach params, tags, logs, artifacts or the card.
Re-publishing the same runs renders the same bytes; upload_folder then skips every unchanged file and makes no
commit (it returns the current head), and the registry reuses the version already made from the GRPO run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from pathlib import Path

from .. import card as cards
from .. import tracking
from ..configs import PublishConfig
from ..errors import SlmsqlError
from ..hub import check_repo_id, hub_id, hub_token, push, same_model
from ..outputs import Staged
from ..registry import register, registry_name

log = logging.getLogger(__name__)
REQUIRED = ("base_model", "license", "tags", "model-index")


def _same_base(run, model: str, role: str) -> None:
    other = run.data.tags.get("slmsql.model", "")
    if not same_model(other, model):
        raise SlmsqlError(f"{role} run {run.info.run_id} evaluated base model {other!r}, but the GRPO run trained "
                          f"on {model!r}: the card would compare different models")


def gather(cfg: PublishConfig, tmp: Path) -> tuple[cards.Runs, Path]:
    """Every run the card cites, checked; returns them and the downloaded adapter folder."""
    import mlflow

    from ..models import check_adapter_base

    client = mlflow.MlflowClient()
    sweep_run, sweep, eval_runs = None, None, cfg.eval_runs
    if cfg.sweep_run:
        sweep_run = tracking.stage_run_of(client, cfg.sweep_run, "sweep", "sweep")
        sweep = json.loads(tracking.download(cfg.sweep_run, "report/sweep.json", tmp / "sweep").read_text())
        cell = next((c for c in sweep["cells"] if c["grpo_run"] == cfg.grpo_run), None)
        if cell is None:
            raise SlmsqlError(f"GRPO run {cfg.grpo_run} is not a cell of sweep run {cfg.sweep_run}")
        eval_runs = eval_runs or list(cell["eval_runs"].values())
    if not eval_runs:
        raise SlmsqlError("give --eval-runs: the card's results (model-index) come from evaluation runs")
    grpo = tracking.stage_run_of(client, cfg.grpo_run, "grpo", "GRPO")
    model = grpo.data.tags.get("slmsql.model", "")
    if hub_id(model) is None:
        if not cfg.dry_run:
            raise SlmsqlError(f"the GRPO run's base model {model!r} is a local checkpoint, not a Hub model id: an "
                              "adapter on it cannot be published (train on a Hub id; --dry-run writes the folder)")
        log.warning("base model %r is a local checkpoint: this card could be written, not pushed", model)
    evals, baselines = [], {}
    for run_id in eval_runs:
        run = tracking.stage_run_of(client, run_id, "evaluate", "evaluation")
        _same_base(run, model, "evaluation")
        metrics = json.loads(tracking.download(run_id, "metrics.json", tmp / run_id).read_text())
        baseline = (metrics.get("comparison") or {}).get("baseline_run")
        if baseline:
            baselines[baseline] = tracking.stage_run_of(client, baseline, "evaluate", "baseline evaluation")
            _same_base(baselines[baseline], model, "baseline evaluation")
        evals.append((run, metrics))
    datasets = [run.data.tags.get("slmsql.dataset") for run, _ in evals]
    if len(set(datasets)) != len(datasets):
        raise SlmsqlError(f"two evaluation runs on one dataset ({datasets}): give one per dataset")
    adapter = tracking.download(grpo.info.run_id, "adapter", tmp / "grpo")
    check_adapter_base(adapter, model)  # the artifact is an adapter for the model the run names
    runs = cards.Runs(grpo=grpo, adapter_config=json.loads((adapter / "adapter_config.json").read_text()),
                      evals=evals, baselines=baselines, sweep_run=sweep_run, sweep=sweep,
                      history={k: [m.value for m in client.get_metric_history(grpo.info.run_id, k)]
                               for _, k, _, _ in cards.TELEMETRY})
    if cfg.filter_run:
        runs.filter = tracking.stage_run_of(client, cfg.filter_run, "filter", "filter")
        runs.filter_summary = json.loads(tracking.download(cfg.filter_run, "summary.json", tmp / "filter").read_text())
        trained = _rl_rows(grpo)
        band = runs.filter_summary["buckets"]["band"]
        if trained is not None and trained != band:
            raise SlmsqlError(f"filter run {cfg.filter_run} kept {band} band questions, but GRPO run {cfg.grpo_run} "
                              f"trained on {trained}: not the same RL data")
    return runs, adapter


def _rl_rows(grpo) -> int | None:
    """Rows of the RL data the GRPO run logged as its training input (None when it logged none)."""
    for item in grpo.inputs.dataset_inputs if grpo.inputs else []:
        if item.dataset.name == "rl" and item.dataset.profile:
            return json.loads(item.dataset.profile).get("num_rows")
    return None


def check_card(text: str, data) -> None:
    """What the Hub reads: the front matter parses, holds the required fields, and round-trips exactly."""
    from huggingface_hub import ModelCard

    try:
        parsed = ModelCard(text).data.to_dict()
    except Exception as e:  # yaml errors, or ModelCardData refusing the metadata
        raise SlmsqlError(f"rendered card: the front matter does not parse ({e})") from None
    missing = [k for k in REQUIRED if not parsed.get(k)] + ([] if parsed.get("library_name") == "peft"
                                                            else ["library_name: peft"])
    if missing or not parsed["model-index"][0].get("results"):
        raise SlmsqlError(f"rendered card: missing {missing or ['model-index results']}")
    if parsed != data.to_dict():
        raise SlmsqlError("rendered card: the front matter does not round-trip through huggingface_hub.ModelCard")


def main(cfg: PublishConfig) -> dict:
    import mlflow

    check_repo_id(cfg.repo_id)
    name = registry_name(cfg)
    token = hub_token(cfg.dry_run)
    tracking.configure()
    st = Staged(cfg.output_dir, cfg.overwrite)  # refused before any download if the folder is in the way
    with tempfile.TemporaryDirectory() as tmp:
        runs, adapter = gather(cfg, Path(tmp))
        # eval runs taken from the sweep's cell are named as if given: in the card's command and the registry
        cfg = dataclasses.replace(cfg, eval_runs=[run.info.run_id for run, _ in runs.evals])
        ctx = cards.context(runs, cfg)
        data = cards.card_data(ctx, cfg.license)
        text = cards.render(ctx, data)
        check_card(text, data)
        with st:
            shutil.copytree(adapter, st.work, dirs_exist_ok=True)
            (st.work / "README.md").write_text(text, encoding="utf-8")  # replaces PEFT's placeholder card
    out = Path(cfg.output_dir)
    result = {"output_dir": str(out), "files": sorted(p.name for p in out.iterdir())}
    with tracking.stage_run("publish", cfg, tags={"slmsql.grpo_run": cfg.grpo_run, "slmsql.repo_id": cfg.repo_id}):
        mlflow.log_artifact(str(out / "README.md"), "card")
        if not cfg.dry_run:
            hub = push(cfg, token, out)
            tags = {"slmsql.hub_url": hub["hub_url"], "slmsql.hub_commit": hub["hub_commit"]}
            for key, value in tags.items():
                mlflow.MlflowClient().set_tag(cfg.grpo_run, key, value)
            mlflow.set_tags(tags)
            mlflow.log_metric("hub_new_commit", float(hub["new_commit"]))
            result.update(hub)
            if name:
                result.update(register(name, cfg, hub))
        tracking.log_json(result, "publish.json")
    log.info("publish: %s", json.dumps(result))
    return result
