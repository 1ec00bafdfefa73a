"""Where a model comes from: what a model name refers to (a Hub id or a path) and what its files say about it.

Model names (one rule, used by model loading, adapter checks, the card and publish): a Hub id is `name` or
`org/name`; anything starting with `/`, `./`, `../`, `~` or holding more than one `/` is a path. A local
Hub-cache snapshot (`.../models--org--name/snapshots/<rev>`) is that Hub id's weights.

Provenance: a model folder or cached snapshot may hold `slmsql_provenance.json`, saying where its weights came from
when they are not the repo's own (scripts/smollm2.py writes one for a model converted from a quantized GGUF).
`provenance` reads it, so runs and cards can say so for any model that carries one.
"""

from __future__ import annotations

import re
from pathlib import Path

from slmsql.errors import SlmsqlError

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
