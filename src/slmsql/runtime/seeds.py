"""Per-sample seeds, shared by both generation backends (generation/sampling.py for transformers,
generation/vllm_engine.py for vLLM): a sampled completion depends only on (seed, its prompt's key, its index), never on its batch."""

from __future__ import annotations

import hashlib


def sample_seed(seed: int, key: str, index: int) -> int:
    """The seed of sample `index` of the prompt keyed `key`: a stable hash (Python's hash() is salted per
    process), 63 bits so it fits torch's and vLLM's seeds."""
    digest = hashlib.blake2b(f"{seed}\x00{key}\x00{index}".encode("utf-8", "surrogatepass"), digest_size=8)
    return int.from_bytes(digest.digest(), "big") >> 1
