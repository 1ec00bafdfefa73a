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

import json
import logging
import shutil
import tempfile
from pathlib import Path

from . import card as cards
from .configs import PublishConfig
from .errors import SlmsqlError
from .outputs import check_free, staged

log = logging.getLogger(__name__)
REQUIRED = ("base_model", "license", "tags", "model-index")


def check_repo_id(repo_id: str) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise SlmsqlError(f"--repo-id {repo_id!r}: {e}") from None
    if repo_id.count("/") != 1:
        raise SlmsqlError(f"--repo-id {repo_id!r}: must be OWNER/NAME (a user or organization, then the name)")


def registry_name(cfg: PublishConfig) -> str | None:
    """The registered model's name (None: skip the registry), checked with MLflow's own rules up front."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils import validation

    name = cfg.registered_model or cfg.repo_id.split("/")[1]
    if name.lower() == "none":
        return None
    try:
        validation._validate_model_name(name)
        if "'" in name:
            raise MlflowException(f"Invalid model name {name!r}: no quotes")
        if cfg.alias:
            validation._validate_model_alias_name(cfg.alias)
            validation._validate_model_alias_name_reserved(cfg.alias)
    except MlflowException as e:
        raise SlmsqlError(f"registry: {e.message}") from None
    return name


def hub_token(dry_run: bool) -> str | None:
    if dry_run:
        return None
    from huggingface_hub import get_token

    token = get_token()  # HF_TOKEN, then the token file of `hf auth login`
    if not token:
        raise SlmsqlError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (or use --dry-run)")
    return token


def _run(client, run_id: str, stage: str, role: str):
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise SlmsqlError(f"{role} run {run_id!r} does not exist in {mlflow.get_tracking_uri()}") from None
    got = run.data.tags.get("slmsql.stage")
    if got != stage:
        raise SlmsqlError(f"{role} run {run_id} has stage {got!r}, expected {stage!r}")
    if run.info.status != "FINISHED":
        raise SlmsqlError(f"{role} run {run_id} is {run.info.status}: publish only finished runs")
    return run


def _download(run_id: str, path: str, dst: Path) -> Path:
    import mlflow
    from mlflow.exceptions import MlflowException

    dst.mkdir(parents=True, exist_ok=True)
    try:
        return Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=path, dst_path=str(dst)))
    except (MlflowException, OSError) as e:
        raise SlmsqlError(f"run {run_id} has no artifact {path!r} ({e})") from None


def _same_base(run, model: str, role: str) -> None:
    other = run.data.tags.get("slmsql.model", "")
    if not cards._same(other, model):
        raise SlmsqlError(f"{role} run {run.info.run_id} evaluated base model {other!r}, but the GRPO run trained "
                          f"on {model!r}: the card would compare different models")


def gather(cfg: PublishConfig, tmp: Path) -> tuple[cards.Runs, Path]:
    """Every run the card cites, checked; returns them and the downloaded adapter folder."""
    import mlflow

    from .models import check_adapter_base

    client = mlflow.MlflowClient()
    eval_ids = [r.strip() for r in cfg.eval_runs.split(",") if r.strip()]
    if not eval_ids:
        raise SlmsqlError("give --eval-runs: the card's results (model-index) come from evaluation runs")
    grpo = _run(client, cfg.grpo_run, "grpo", "GRPO")
    model = grpo.data.tags.get("slmsql.model", "")
    if cards.hub_base_model(model) is None:
        if not cfg.dry_run:
            raise SlmsqlError(f"the GRPO run's base model {model!r} is a local checkpoint, not a Hub model id: an "
                              "adapter on it cannot be published (train on a Hub id; --dry-run writes the folder)")
        log.warning("base model %r is a local checkpoint: this card could be written, not pushed", model)
    evals, baselines = [], {}
    for run_id in eval_ids:
        run = _run(client, run_id, "evaluate", "evaluation")
        _same_base(run, model, "evaluation")
        metrics = json.loads(_download(run_id, "metrics.json", tmp / run_id).read_text())
        baseline = (metrics.get("comparison") or {}).get("baseline_run")
        if baseline:
            baselines[baseline] = _run(client, baseline, "evaluate", "baseline evaluation")
            _same_base(baselines[baseline], model, "baseline evaluation")
        evals.append((run, metrics))
    datasets = [run.data.tags.get("slmsql.dataset") for run, _ in evals]
    if len(set(datasets)) != len(datasets):
        raise SlmsqlError(f"two evaluation runs on one dataset ({datasets}): give one per dataset")
    adapter = _download(grpo.info.run_id, "adapter", tmp / "grpo")
    check_adapter_base(adapter, model)  # the artifact is an adapter for the model the run names
    runs = cards.Runs(grpo=grpo, adapter_config=json.loads((adapter / "adapter_config.json").read_text()),
                      evals=evals, baselines=baselines,
                      history={k: [m.value for m in client.get_metric_history(grpo.info.run_id, k)]
                               for _, k, _, _ in cards.TELEMETRY})
    if cfg.filter_run:
        runs.filter = _run(client, cfg.filter_run, "filter", "filter")
        runs.filter_summary = json.loads(_download(cfg.filter_run, "summary.json", tmp / "filter").read_text())
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


def push(cfg: PublishConfig, token: str, folder: Path) -> dict:
    import httpx2  # huggingface_hub 2.4's HTTP client: its errors cover refused connections and timeouts
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=cfg.endpoint or None, token=token)
    try:
        url = api.create_repo(cfg.repo_id, private=cfg.private, exist_ok=True)
        before = api.model_info(cfg.repo_id)  # an upload that changes nothing returns this head
        if before.private is not None and before.private != cfg.private:  # exist_ok leaves visibility as it is
            log.warning("%s already exists and stays %s", cfg.repo_id, "private" if before.private else "public")
        stale = sorted({s.rfilename for s in before.siblings or []} - {p.name for p in folder.iterdir()}
                       - {".gitattributes"})
        if stale:
            log.warning("%s also holds files this card does not describe: %s", cfg.repo_id, stale)
        commit = api.upload_folder(repo_id=cfg.repo_id, folder_path=folder,
                                   commit_message=f"GRPO adapter from MLflow run {cfg.grpo_run}",
                                   commit_description=f"slmsql publish; evaluation runs: {cfg.eval_runs}; "
                                                      f"filter run: {cfg.filter_run or 'none'}")
    except (HfHubHTTPError, httpx2.HTTPError, ValueError, OSError) as e:
        raise SlmsqlError(f"pushing to {cfg.repo_id} failed: {e}") from None
    new = commit.oid != before.sha
    log.info("%s: %s %s", url, "new commit" if new else "unchanged, no commit; head is", commit.oid)
    return {"hub_url": str(url), "hub_commit": commit.oid, "new_commit": new}


def register(name: str, cfg: PublishConfig, hub: dict) -> dict:
    """A registry version of the GRPO run's adapter (reused when this run was registered before), tagged and aliased.

    `mlflow.register_model("runs:/<id>/adapter")` needs an MLflow model (MLmodel) there; the adapter is a plain
    PEFT folder, so the version is created directly with that runs:/ URI as its source."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient()
    source = f"runs:/{cfg.grpo_run}/adapter"
    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    same = [v for v in client.search_model_versions(f"name='{name}'")
            if v.run_id == cfg.grpo_run and v.source == source]
    version = same[0] if same else client.create_model_version(name, source, run_id=cfg.grpo_run)
    tags = {"hub_repo": cfg.repo_id, "hub_url": hub["hub_url"], "hub_commit": hub["hub_commit"],
            "grpo_run": cfg.grpo_run, "eval_runs": cfg.eval_runs, "filter_run": cfg.filter_run}
    for key, value in tags.items():
        client.set_model_version_tag(name, version.version, key, value)
    if cfg.alias:
        client.set_registered_model_alias(name, cfg.alias, version.version)
    log.info("registered %s version %s%s", name, version.version, f" as @{cfg.alias}" if cfg.alias else "")
    return {"registered_model": name, "model_version": int(version.version)}


def main(cfg: PublishConfig) -> dict:
    import mlflow

    from . import tracking

    check_repo_id(cfg.repo_id)
    name = registry_name(cfg)
    token = hub_token(cfg.dry_run)
    tracking.configure()
    check_free(cfg.output_dir, cfg.overwrite)
    with tempfile.TemporaryDirectory() as tmp:
        runs, adapter = gather(cfg, Path(tmp))
        ctx = cards.context(runs, cfg)
        data = cards.card_data(ctx, cfg.license)
        text = cards.render(ctx, data)
        check_card(text, data)
        with staged(cfg.output_dir, cfg.overwrite) as work:
            shutil.copytree(adapter, work, dirs_exist_ok=True)
            (work / "README.md").write_text(text, encoding="utf-8")  # replaces PEFT's placeholder card
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
