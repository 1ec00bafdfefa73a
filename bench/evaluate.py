"""Evaluation throughput: batched greedy generation vs one prompt at a time, same outputs, in one run.

Builds its own toy world (`slmsql.toy.world`) and, unless `--model` is given, the embedded tiny model
(`slmsql.toy.tiny_model.build_tiny_model`, tokenizer trained on the toy world's sft texts) in a temp dir, renders
`--n` dev questions as prompts (`PromptBuilder` + `render_prompt`), then times `slmsql.generation.sampling.generate`
with `batch_size=1` and with `--batch-size`, greedy both times, on the same prompts, after one warm-up call.
The two runs must produce identical completions: the tiny model runs in fp32, where left padding changes
no argmax, so a mismatch there is a bug and the script exits 1. A `--model` in bf16 on a GPU may legitimately
flip near-tied tokens under padding: there the mismatch count is only reported.

The tiny model is untrained (training it takes minutes): it rarely emits its end token, so nearly every
completion runs to `--max-new-tokens` and the work is close to fixed: the best case for batching (no
finished rows riding along in a batch); a trained model that stops early gains less. tokens/s counts the
tokens the one-at-a-time run generated (up to and including the end token), for both runs: the useful work.

    PYTHONPATH=src python bench/evaluate.py [--n 64] [--batch-size 16] [--max-new-tokens 64]
    python bench/evaluate.py --model Qwen/Qwen2.5-Coder-1.5B-Instruct --n 256 --max-new-tokens 256  # GPU

`--shared-schema` measures instead each schema computed once (generation/shared_schema.py) against the plain
path, on the same questions in one run: greedy, `--batch-size` both, prefill tokens counted on the model's forwards
(`shared_schema.counting_prefill`: real tokens, and positions with padding), wall seconds, and how many answers
differ (the near-tie rule, tests/neartie.py, says whether they may: the tests check it). With `--spider DIR` (Spider's
dev.json and tables.json) the prompts are Spider's: its first `--n` dev questions, as `evaluate --limit` takes them,
prompted from tables.json in omnisql style; `--plan-n` gives the prefill tokens of both paths for more questions,
counted from the batches without generating (the tokens depend on the prompts only).

    PYTHONPATH=src python bench/evaluate.py --shared-schema --spider .cache/spider \
        --model HuggingFaceTB/SmolLM2-135M-Instruct --n 40 --max-new-tokens 128 --plan-n 300,1034
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from slmsql.configs import TinyModelConfig
from slmsql.inputs.data import read_gold
from slmsql.policy.models import load_model
from slmsql.toy.tiny_model import build_tiny_model
from slmsql.inputs.prompts import PromptBuilder, render_prompt
from slmsql.generation.sampling import generate
from slmsql.stages.tiny_model import training_texts
from slmsql.toy.world import generate as make_toy


def build_world(root: Path, model: str, seed: int) -> tuple[Path, str]:
    """The toy world, and the model to load: `model` if given, else a fresh tiny model built beside it."""
    toy = root / "toy"
    make_toy(toy, seed=seed, size="small")
    if model:
        return toy, model
    texts = training_texts(TinyModelConfig(data=str(toy), prompt_style="compact"))
    return toy, str(build_tiny_model(root / "tiny-model", texts, seed=seed))


def count_new_tokens(model) -> list[int]:
    """Wrap `model.generate` to record how many tokens each call appended: exact per example at batch size 1."""
    counts, inner = [], model.generate

    def generate_and_count(input_ids=None, **kwargs):
        out = inner(input_ids=input_ids, **kwargs)
        counts.append((out.shape[1] - input_ids.shape[1]) * out.shape[0])
        return out

    model.generate = generate_and_count
    return counts


def timed(model, tokenizer, prompts, batch_size, max_new_tokens) -> tuple[list[str], float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = generate(model, tokenizer, prompts, temperature=0.0, max_new_tokens=max_new_tokens,
                   batch_size=batch_size, progress=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return [o[0] for o in out], time.perf_counter() - t0


def plan_tokens(tokens: list[list[int]]) -> dict:
    """Prefill tokens of both paths for these prompts, from the groups alone: plain computes every prompt whole,
    shared each group's prefix once and every prompt's rest."""
    from slmsql.generation.shared_schema import groups

    found = groups(tokens)
    shared = sum(share + sum(len(tokens[i]) - share for i in members) for share, members in found)
    plain = sum(map(len, tokens))
    return {"n": len(tokens), "groups": sum(1 for share, _ in found if share), "plain": plain, "shared": shared,
            "ratio": round(plain / shared, 2)}


def spider_prompts(spider: Path, n: int, tokenizer) -> list[str]:
    """Spider's first `n` dev questions (as `evaluate --limit n` takes them), prompted from tables.json (omnisql)."""
    builder = PromptBuilder(spider / "no-databases", tables_json=spider / "tables.json", style="omnisql")
    return [render_prompt(tokenizer, builder.messages(ex)) for ex in read_gold(spider / "dev.json")[:n]]


def shared_schema_main(args) -> dict:
    from slmsql.generation.shared_schema import counting_prefill

    t_setup = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="slmsql-bench-eval-") as tmp:
        if args.spider:
            model, tokenizer = load_model(args.model or "HuggingFaceTB/SmolLM2-135M-Instruct")
            prompts = spider_prompts(Path(args.spider), args.n, tokenizer)
            source = "spider-dev"
        else:
            toy, model_name = build_world(Path(tmp), args.model, args.seed)
            model, tokenizer = load_model(model_name)
            style = args.prompt_style or ("omnisql" if args.model else "compact")
            builder = PromptBuilder(toy / "databases", example_values=3 if style == "omnisql" else 0, style=style)
            prompts = [render_prompt(tokenizer, builder.messages(ex)) for ex in read_gold(toy / "dev.jsonl")[:args.n]]
            source = "toy-dev"
        tokens = tokenizer(prompts, add_special_tokens=False)["input_ids"]
        print(f"{len(prompts)} {source} prompts ({min(map(len, tokens))}-{max(map(len, tokens))} tokens), "
              f"max_new_tokens {args.max_new_tokens}, batch {args.batch_size}, {torch.get_num_threads()} threads; "
              f"setup {time.perf_counter() - t_setup:.1f} s", flush=True)
        kw = dict(temperature=0.0, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, progress=False)
        generate(model, tokenizer, prompts[:2], **{**kw, "max_new_tokens": 2})  # warm-up
        runs = {}
        for name, flag in (("plain", False), ("shared", True)):
            with counting_prefill(model) as counted:
                t0 = time.perf_counter()
                out = generate(model, tokenizer, prompts, shared_schema=flag, **kw)
                seconds = time.perf_counter() - t0
            prefill_s = counted.pop("seconds")
            runs[name] = {"seconds": round(seconds, 2), "prefill_seconds": round(prefill_s, 2), **counted,
                          "answers": [o[0] for o in out]}
            print(f"{name:6s} {seconds:8.1f} s (prefill {prefill_s:.1f} s)  prefill tokens {counted['tokens']:7d}  "
                  f"positions {counted['positions']:7d}  forwards {counted['forwards']}", flush=True)
        more = []
        if args.spider and args.plan_n:
            for n in map(int, args.plan_n.split(",")):
                more.append(plan_tokens(tokenizer(spider_prompts(Path(args.spider), n, tokenizer),
                                                  add_special_tokens=False)["input_ids"]))
    plain, shared = runs["plain"], runs["shared"]
    mismatches = sum(a != b for a, b in zip(plain.pop("answers"), shared.pop("answers")))
    figures = {
        "mode": "shared-schema", "source": source, "n": len(prompts), "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens, "model": args.model or ("HuggingFaceTB/SmolLM2-135M-Instruct"
                                                                       if args.spider else "tiny-untrained"),
        "threads": torch.get_num_threads(), "plan": plan_tokens(tokens), "plain": plain, "shared": shared,
        "prefill_token_ratio": round(plain["tokens"] / shared["tokens"], 2),
        "prefill_position_ratio": round(plain["positions"] / shared["positions"], 2),
        "speedup": round(plain["seconds"] / shared["seconds"], 2), "mismatches": mismatches, "plan_more": more,
    }
    print(f"prefill tokens {figures['prefill_token_ratio']}x fewer, wall {figures['speedup']}x faster; "
          f"{mismatches} of {len(prompts)} answers differ")
    for p in more:
        print(f"at {p['n']} questions: {p['groups']} groups, prefill tokens {p['plain']} -> {p['shared']} "
              f"({p['ratio']}x fewer)")
    print(json.dumps(figures))
    return figures


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=64, help="dev questions to generate for")
    ap.add_argument("--batch-size", type=int, default=16, help="prompts per batch in the batched run")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--model", default="", help="Hub id or local path (default: a fresh untrained tiny model)")
    ap.add_argument("--prompt-style", default="", choices=("", "compact", "omnisql"),
                    help="default: compact for the tiny model, omnisql for --model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shared-schema", action="store_true",
                    help="measure each schema computed once against the plain path (module docstring)")
    ap.add_argument("--spider", default="",
                    help="with --shared-schema: a folder with Spider's dev.json and tables.json")
    ap.add_argument("--plan-n", default="", help="with --spider: comma-separated question counts whose prefill tokens "
                                                 "are counted from the batches alone, e.g. 300,1034")
    args = ap.parse_args(argv)
    if args.shared_schema:
        return shared_schema_main(args)
    style = args.prompt_style or ("omnisql" if args.model else "compact")
    torch.manual_seed(args.seed)

    t_setup = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="slmsql-bench-eval-") as tmp:
        toy, model_name = build_world(Path(tmp), args.model, args.seed)
        model, tokenizer = load_model(model_name)
        builder = PromptBuilder(toy / "databases", example_values=3 if style == "omnisql" else 0, style=style)
        dev = read_gold(toy / "dev.jsonl")
        examples = [dev[i % len(dev)] for i in range(args.n)]  # cycle when --n exceeds the 200 dev questions
        prompts = [render_prompt(tokenizer, builder.messages(ex)) for ex in examples]
        prompt_tokens = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
        device, dtype = str(model.device), str(model.dtype).replace("torch.", "")
        print(f"{args.n} prompts ({style}, {min(prompt_tokens)}-{max(prompt_tokens)} tokens), "
              f"max_new_tokens {args.max_new_tokens}, model {args.model or 'tiny (untrained)'} "
              f"on {device} in {dtype}, {os.cpu_count()} CPUs; setup {time.perf_counter() - t_setup:.1f} s", flush=True)

        timed(model, tokenizer, prompts[: args.batch_size], args.batch_size, args.max_new_tokens)  # warm-up
        counts = count_new_tokens(model)
        single, t_single = timed(model, tokenizer, prompts, 1, args.max_new_tokens)
        new_tokens = sum(counts)
        batched, t_batched = timed(model, tokenizer, prompts, args.batch_size, args.max_new_tokens)

    mismatches = sum(a != b for a, b in zip(single, batched))
    figures = {
        "n": args.n, "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
        "model": args.model or "tiny-untrained", "device": device, "dtype": dtype, "prompt_style": style,
        "prompt_tokens_mean": round(sum(prompt_tokens) / len(prompt_tokens), 1), "new_tokens": new_tokens,
        "seconds": {"single": round(t_single, 3), "batched": round(t_batched, 3)},
        "examples_per_s": {"single": round(args.n / t_single, 2), "batched": round(args.n / t_batched, 2)},
        "tokens_per_s": {"single": round(new_tokens / t_single, 1), "batched": round(new_tokens / t_batched, 1)},
        "speedup": round(t_single / t_batched, 2),
        "identical_outputs": mismatches == 0, "mismatches": mismatches,
    }
    for name in ("single", "batched"):
        print(f"{name:8s} batch {1 if name == 'single' else args.batch_size:3d}  {figures['seconds'][name]:8.2f} s  "
              f"{figures['examples_per_s'][name]:8.2f} ex/s  {figures['tokens_per_s'][name]:9.1f} tokens/s")
    print(f"speedup {figures['speedup']:.2f}x; identical outputs: {figures['identical_outputs']} "
          f"({mismatches} of {args.n} differ)")
    print(json.dumps(figures))
    if mismatches and not args.model:
        raise SystemExit(1)  # fp32 tiny model: batching must not change greedy output
    return figures


if __name__ == "__main__":
    main()
