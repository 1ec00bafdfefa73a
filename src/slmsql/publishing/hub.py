"""The Hugging Face Hub's publishing side: repo ids, the token, and the one-commit push (model names:
`slmsql.inputs.sources`)."""

from __future__ import annotations

import logging
from pathlib import Path

from slmsql.errors import SlmsqlError

log = logging.getLogger(__name__)


def check_repo_id(repo_id: str) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise SlmsqlError(f"--repo-id {repo_id!r}: {e}") from None
    if repo_id.count("/") != 1:
        raise SlmsqlError(f"--repo-id {repo_id!r}: must be OWNER/NAME (a user or organization, then the name)")


def hub_token(dry_run: bool) -> str | None:
    if dry_run:
        return None
    from huggingface_hub import get_token

    token = get_token()  # HF_TOKEN, then the token file of `hf auth login`
    if not token:
        raise SlmsqlError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (or use --dry-run)")
    return token


def push(cfg, token: str, folder: Path, *, repo_id: str | None = None, message: str | None = None,
         description: str | None = None, ignore: tuple[str, ...] = ()) -> dict:
    """One commit of `folder` (less the `ignore` patterns) to `repo_id` (default cfg.repo_id; created if
    missing); no commit when nothing changed."""
    import fnmatch

    import httpx2  # huggingface_hub 2.4's HTTP client: its errors cover refused connections and timeouts
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    repo_id = repo_id or cfg.repo_id
    api = HfApi(endpoint=cfg.endpoint or None, token=token)
    try:
        url = api.create_repo(repo_id, private=cfg.private, exist_ok=True)
        before = api.model_info(repo_id)  # an upload that changes nothing returns this head
        if before.private is not None and before.private != cfg.private:  # exist_ok leaves visibility as it is
            log.warning("%s already exists and stays %s", repo_id, "private" if before.private else "public")
        local = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
        local = {p for p in local if not any(fnmatch.fnmatch(p, pat) for pat in ignore)}
        stale = sorted({s.rfilename for s in before.siblings or []} - local - {".gitattributes"})
        if stale:
            log.warning("%s also holds files this card does not describe: %s", repo_id, stale)
        commit = api.upload_folder(
            repo_id=repo_id, folder_path=folder, ignore_patterns=list(ignore) or None,
            commit_message=message or f"GRPO adapter from MLflow run {cfg.grpo_run}",
            commit_description=description or (f"slmsql publish; evaluation runs: {','.join(cfg.eval_runs)}; "
                                               f"filter run: {cfg.filter_run or 'none'}"))
    except (HfHubHTTPError, httpx2.HTTPError, ValueError, OSError) as e:
        raise SlmsqlError(f"pushing to {repo_id} failed: {e}") from None
    new = commit.oid != before.sha
    log.info("%s: %s %s", url, "new commit" if new else "unchanged, no commit; head is", commit.oid)
    return {"hub_url": str(url), "hub_commit": commit.oid, "new_commit": new}
