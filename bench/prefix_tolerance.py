"""What the shared-prefix self-check measures, per dtype: max |log p(shared) - log p(plain)| over the completion
tokens of a micro-batch, beside the same statistic with a wrong mask (completions that see each other), on a real
model. `slmsql.training.shared_prefix_trainer.TOLERANCE` (float32) is set between the two; bfloat16 shows why the check
computes in float32 whatever the run's precision: its own rounding there comes near what a wrong mask moves.

Micro-batches: 3 prompts of random tokens (300, 220 and 260 tokens, left-padded) in 6 rows (a group cut by the
micro-batch), completions of 64, 30, 5, 50, 0 and 64 random tokens; `--batches` of them, each with its own seed.
The plain path is TRL's `_get_per_token_logps_and_entropies` (the fused LM head at temperature 0.8), dropout off.

    flock /tmp/slmsql-cpu.lock env OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 PYTHONPATH=src \
        python bench/prefix_tolerance.py --model HuggingFaceTB/SmolLM2-135M-Instruct

The last printed line is JSON.
"""

from __future__ import annotations

import argparse
import json
import types

import torch

PROMPTS, LENGTHS, WIDTH = (300, 220, 260), (64, 30, 5, 50, 0, 64), 64
ROWS = ("A", "B", "A", "C", "A", "B")


def micro_batch(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = {k: torch.randint(5, vocab, (n,), generator=g) for k, n in zip("ABC", PROMPTS)}
    plen = max(PROMPTS)
    ids = torch.zeros(len(ROWS), plen + WIDTH, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (k, n) in enumerate(zip(ROWS, LENGTHS)):
        p = prompts[k]
        ids[i, plen - len(p):plen], mask[i, plen - len(p):plen] = p, 1
        ids[i, plen:plen + n], mask[i, plen:plen + n] = torch.randint(5, vocab, (n,), generator=g), 1
    return ids, mask


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="Hub id or folder")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", type=int, default=3)
    args = ap.parse_args(argv)
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    from slmsql.generation.shared_prefix import Packing, packed_logps
    from slmsql.training.shared_prefix_trainer import TOLERANCE

    plain_path = GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__  # TRL's, without its profiler
    trainer = types.SimpleNamespace(accelerator=Accelerator(cpu=not torch.cuda.is_available()))
    out = {"model": args.model, "threads": torch.get_num_threads(), "dtypes": {}}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
        add_fused_lm_head(model, temperature=0.8)
        shared, wrong = [], []
        for seed in range(args.batches):
            ids, mask = micro_batch(model.config.vocab_size, seed)
            scored = mask[:, -WIDTH:].bool()
            with torch.no_grad():
                plain = plain_path(trainer, model, ids, mask, WIDTH)[0]
                packing = Packing.of(ids, mask, WIDTH)
                shared.append((packed_logps(model, packing)[0] - plain).abs()[scored].max().item())
                packing.segment = packing.segment.clamp(max=1)  # every completion sees the others
                wrong.append((packed_logps(model, packing)[0] - plain).abs()[scored].max().item())
        out["dtypes"][name] = {"shared": [float(f"{x:.3g}") for x in shared],
                               "wrong_mask": [float(f"{x:.3g}") for x in wrong], "tolerance": TOLERANCE.get(dtype)}
        print(f"{name:9s} shared vs plain {max(shared):.3g} (max of {args.batches}), wrong mask {min(wrong):.3g} "
              f"(min), tolerance {TOLERANCE.get(dtype, 'none: the check computes in float32')}", flush=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
