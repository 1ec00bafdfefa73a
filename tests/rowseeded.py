"""Sampling that depends only on (prompt, place in its GRPO group), not on how the batch is laid out across
processes: the test-only generation patch behind the multi-process equivalence test.

Why it is needed: TRL reseeds every process with `seed + rank` (`set_seed(seed, device_specific=True)`, so
that two processes never draw the same completions) and each process samples its whole batch from one
random stream. One process with 16 rows and two with 8 rows each therefore draw other completions for the
same prompts, and GRPO trains on whatever was drawn: the adapters differ by design, not by a bug. With this
patch each row is generated alone, unpadded, from a generator seeded by its prompt tokens and its index in
the group; the trainer's RNG stream is left as it was. Then both layouts train on the same completions, and
what remains to compare is the distributed training itself (sampler split, rewards gathered across processes
for the group advantages, token-count normalisation, DDP gradient averaging).

`row_seeded(generate, G)` is the patched function; `install(G)` puts it in transformers' `GenerationMixin`.
Run as a script (`python tests/rowseeded.py <slmsql args>`, e.g. under `accelerate launch`), it installs the
patch with G = SLMSQL_TEST_GROUP and runs the slmsql CLI; with SLMSQL_TEST_PIN_DATA (the gold file) and
SLMSQL_TEST_PIN_MODEL (the tokenizer) it installs `install_pinned`: two completions of each group scripted, so
the run has a reward difference in every group whatever the sampler draws on this machine.
"""

from __future__ import annotations

import os
import sys
import zlib


def row_seeded(original, group: int):
    """`original` (transformers' generate) made to sample each row from its own (prompt, index) seed."""
    import torch
    import torch.nn.functional as F

    def generate(self, input_ids=None, attention_mask=None, generation_config=None, **kwargs):
        # Rows arrive grouped: each prompt repeated `group` times in a row, and every process's slice starts
        # at a group boundary (slmsql requires num_generations to divide the per-device batch).
        kwargs.pop("cache", None)  # the batch's shared prefill (shared_prefix.generate): each row here runs alone
        rows = []
        for i in range(input_ids.size(0)):
            ids = input_ids[i][attention_mask[i].bool()][None]
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(zlib.crc32(ids.numpy().tobytes()) * 131 + i % group)
                out = original(self, input_ids=ids, attention_mask=torch.ones_like(ids),
                               generation_config=generation_config, **kwargs)
            rows.append(out[0, ids.size(1):])
        width = max(r.size(0) for r in rows)
        pad = generation_config.pad_token_id
        completions = torch.stack([F.pad(r, (0, width - r.size(0)), value=pad) for r in rows])
        return torch.cat([input_ids, completions], dim=1)

    return generate


def install(group: int) -> None:
    from transformers.generation.utils import GenerationMixin

    GenerationMixin.generate = row_seeded(GenerationMixin.generate, group)


def install_pinned(group: int, model: str, data: str) -> None:
    """`install`, with the first two completions of every group pinned (tests/scripted.py): gold SQL, then no
    SQL. Every group then has a reward difference, so every step has a gradient to compare across layouts."""
    import json

    import scripted
    from transformers.generation.utils import GenerationMixin

    rows = [json.loads(line) for line in open(data) if line.strip()]
    GenerationMixin.generate = scripted.scripted_generate(
        model, scripted.right_and_no_sql_first(rows), group, sample=row_seeded(GenerationMixin.generate, group))


if __name__ == "__main__":
    group = int(os.environ["SLMSQL_TEST_GROUP"])
    if os.environ.get("SLMSQL_TEST_PIN_DATA"):  # SLMSQL_TEST_PIN_MODEL: the tokenizer's folder
        install_pinned(group, os.environ["SLMSQL_TEST_PIN_MODEL"], os.environ["SLMSQL_TEST_PIN_DATA"])
    else:
        install(group)
    from slmsql.cli import main

    sys.exit(main(sys.argv[1:], prog_name="slmsql"))
