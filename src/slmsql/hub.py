"""The Hugging Face Hub side: what a model name refers to, repo ids, the token, and the one-commit push.

Model names (one rule, used by model loading, adapter checks, the card and publish): a Hub id is `name` or
`org/name`; anything starting with `/`, `./`, `../`, `~` or holding more than one `/` is a path. A local
Hub-cache snapshot (`.../models--org--name/snapshots/<rev>`) is that Hub id's weights.

Provenance: a model folder or cached snapshot may hold `slmsql_provenance.json`, saying where its weights came from
when they are not the repo's own (scripts/smollm2.py writes one for a model converted from a quantized GGUF).
`provenance` reads it, so runs and cards can say so for any model that carries one.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from .errors import SlmsqlError

log = logging.getLogger(__name__)
_SNAPSHOT = re.compile(r"models--([\w.-]+)--([\w.-]+)")


def is_path(name: str) -> bool:
    """Meant as a filesystem path (so never looked up on the Hub, which would only cost retries)."""
    return str(name).startswith(("/", "./", "../", "~")) or str(name).count("/") > 1


def snapshot_id(name: str) -> str | None:
    """`org/name` when `name` is (inside) a Hub-cache snapshot folder, else None."""
    m = _SNAPSHOT.search(str(name))
    return f"{m[1]}/{m[2]}" if m else None


def hub_id(model: str) -> str | None:
    """The Hub id of a base model, or None when it is only a local checkpoint (a full fine-tune, a private
    checkpoint): an adapter on such a base can be written out (--dry-run) but not published against it."""
    if snap := snapshot_id(model):
        return snap
    return None if not model or Path(model).expanduser().is_dir() or is_path(model) else model


def same_model(a: str, b: str) -> bool:
    """The loose rule runs are matched by: the same name, or the same last path component."""
    a, b = (str(x or "").strip().rstrip("/").lower() for x in (a, b))
    return a == b or (bool(a) and bool(b) and a.rsplit("/", 1)[-1] == b.rsplit("/", 1)[-1])


PROVENANCE = "slmsql_provenance.json"


def provenance(model: str, cache_dir: str | Path | None = None) -> dict | None:
    """The provenance record of a model folder or Hub id (see the module docstring), or None when it has none.
    A Hub id is looked up in the local cache only (`cache_dir`, default the Hub cache): never downloaded."""
    import json

    path = Path(str(model)).expanduser()
    if path.is_dir():
        file = path / PROVENANCE
    elif is_path(str(model)):
        return None
    else:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(str(model), PROVENANCE, cache_dir=cache_dir)
        file = Path(found) if isinstance(found, str) else None
    if file is None or not file.is_file():
        return None
    try:
        record = json.loads(file.read_text())
    except ValueError as e:
        raise SlmsqlError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(record, dict):
        raise SlmsqlError(f"{file}: expected a JSON object, got {type(record).__name__}")
    return record


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
