"""vLLM sampling of K completions per prompt (n = K, one request), prefix caching off vs on: does the engine prefill a
prompt once for its K samples? (slmsql's engines turn it on: vllm_engine.load.)

Each arm runs in a process of its own (one engine per process, as the stages run), in turn: `off`, `on`, and `warm`
(on, after a max_tokens=1 pass over the same prompts, so every prompt block is cached before the K samples start).
Prompts: the first `--n` toy rl_source questions, chat-templated with the model's tokenizer (compact schema);
K = `--k` samples at temperature 0.8 of up to `--max-new-tokens`, one `generate` call after a warm-up on other
prompts. Times the call; the same completion tokens in every arm (the same seeds) are reported beside it.

    flock /tmp/slmsql-cpu.lock env OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 PYTHONPATH=src \
        python bench/vllm_prefix.py --model HuggingFaceTB/SmolLM2-135M-Instruct

The last printed line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def arm(args) -> dict:
    from slmsql.generation.vllm_engine import ENV

    for key, value in ENV.items():  # as slmsql's engines run: in-process, a 1 GiB KV cache (vLLM's CPU default is
        os.environ.setdefault(key, value)  # 4 GiB, zero-filled at each start: minutes of system time on 2 cores)
    import vllm
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from slmsql import configs
    from slmsql.toy import world as toyworld
    from slmsql.inputs.data import read_gold
    from slmsql.inputs.prompts import builder_for, render_prompt

    with tempfile.TemporaryDirectory() as tmp:
        toyworld.generate(Path(tmp) / "toy", seed=0, size="small")
        examples = read_gold(Path(tmp) / "toy" / "rl_source.jsonl")[:args.n]
        cfg = configs.load(configs.FilterConfig, None, {"db_root": str(Path(tmp) / "toy" / "databases")})
        tok = AutoTokenizer.from_pretrained(args.model)
        prompts = [tok(render_prompt(tok, builder_for(cfg).messages(e)), add_special_tokens=False).input_ids
                   for e in examples]
    need = max(map(len, prompts)) + args.max_new_tokens
    llm = vllm.LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=need, seed=0,
                   enable_prefix_caching=args.arm != "off", max_num_seqs=args.n * args.k,
                   max_num_batched_tokens=args.n * args.k * need)  # every sequence's prefill fits one step
    requests = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(n=args.k, temperature=0.8, max_tokens=args.max_new_tokens, seed=i, detokenize=False)
              for i in range(len(prompts))]
    llm.generate([{"prompt_token_ids": p[::-1]} for p in prompts[:4]], SamplingParams(n=2, max_tokens=4, seed=0),
                 use_tqdm=False)  # warm-up on prompts that share no block with the timed ones
    t0 = time.perf_counter()
    if args.arm == "warm":
        llm.generate(requests, SamplingParams(max_tokens=1, seed=0), use_tqdm=False)
    done = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for r in done for c in r.outputs)
    return {"seconds": round(seconds, 2), "completion_tokens": tokens, "prompt_tokens": sum(map(len, prompts))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="Hub id or folder")
    ap.add_argument("--arms", default="off,on,warm")
    ap.add_argument("--arm", default="", help=argparse.SUPPRESS)  # one arm, in this process
    ap.add_argument("--n", type=int, default=8, help="prompts")
    ap.add_argument("--k", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    if args.arm:
        print(json.dumps(arm(args)))
        return
    results = {}
    for name in args.arms.split(","):
        done = subprocess.run([sys.executable, __file__, "--arm", name, "--model", args.model, "--n", str(args.n),
                               "--k", str(args.k), "--max-new-tokens", str(args.max_new_tokens)],
                              capture_output=True, text=True, timeout=1800)
        if done.returncode:
            sys.exit(f"arm {name} failed:\n{done.stderr[-3000:]}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{name:5s} {results[name]['seconds']:7.2f} s, {results[name]['completion_tokens']} completion tokens",
              flush=True)
    out = {"model": args.model, "n": args.n, "k": args.k, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
           "arms": results}
    if {"off", "on"} <= set(results):
        out["caching_speedup"] = round(results["off"]["seconds"] / results["on"]["seconds"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
