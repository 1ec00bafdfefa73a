"""The MLflow Model Registry side of publishing: a checked name, and a version of the GRPO run's text2sql model."""

from __future__ import annotations

import logging

from slmsql.errors import SlmsqlError

log = logging.getLogger(__name__)
DRY_RUN_ALIAS = "dry-run"  # a dry run's version: never --alias, which names pushed versions (candidate)


def registry_name(cfg) -> str | None:
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
    if cfg.alias.lower() == DRY_RUN_ALIAS and not cfg.dry_run:
        raise SlmsqlError(f"--alias {cfg.alias}: the alias of dry runs' versions (nothing pushed); a pushed "
                          "version takes another (default candidate)")
    return name


def alias_of(cfg) -> str:
    """The alias the new version takes: --alias for a push, DRY_RUN_ALIAS for a dry run, so that a dry run never
    takes an alias (candidate) from a pushed version."""
    return DRY_RUN_ALIAS if cfg.dry_run else cfg.alias


def register(name: str, cfg, pushed: dict, model_uri: str) -> dict:
    """A registry version of the GRPO run's text2sql model (`model_uri`, logged to that run; the version made
    from it before is reused), tagged with what was pushed (`pushed`: publish's Hub facts, none for a dry run),
    and aliased (`alias_of`)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient()
    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    same = [v for v in client.search_model_versions(f"name='{name}'")
            if v.run_id == cfg.grpo_run and v.source == model_uri]
    version = same[0] if same else mlflow.register_model(model_uri, name)
    tags = {"hub_repo": cfg.repo_id, "grpo_run": cfg.grpo_run, "eval_runs": ",".join(cfg.eval_runs),
            "filter_run": cfg.filter_run, "flavor": "text2sql (mlflow.pyfunc)"}
    if "hub_commit" in pushed:
        tags.update(hub_url=pushed["hub_url"], hub_commit=pushed["hub_commit"])
    else:  # a dry run: hub_repo is where a push would go
        tags.update(pushed="no (publish --dry-run)")
    if cfg.base_repo:
        tags.update(base_repo=cfg.base_repo)
        if "base_hub_commit" in pushed:
            tags.update(base_commit=pushed["base_hub_commit"])
    for key, value in tags.items():
        client.set_model_version_tag(name, version.version, key, value)
    alias = alias_of(cfg)
    if alias:
        client.set_registered_model_alias(name, alias, version.version)
    log.info("registered %s version %s%s", name, version.version, f" as @{alias}" if alias else "")
    return {"registered_model": name, "model_version": int(version.version), "model_uri": model_uri,
            **({"alias": alias} if alias else {})}
