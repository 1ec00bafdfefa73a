"""vLLM sampling of K completions per prompt (n = K, one request), prefix caching off vs on: does the engine prefill a
prompt once for its K samples? (slmsql's engines turn it on: vllm_engine.load.)

Each arm runs in a process of its own (one engine per process, as the stages run), in turn: `off`, `on`, and `warm`
(on, after a max_tokens=1 pass over the same prompts, so every prompt block is cached before the K samples start).
Prompts: the first `--n` toy rl_source questions, chat-templated with the model's tokenizer (compact schema);
K = `--k` samples at temperature 0.8 of up to `--max-new-tokens`, one `generate` call after a warm-up on other
prompts. Times the call; the same completion tokens in every arm (the same seeds) are reported beside it.

    flock /tmp/slmsql-cpu.lock env OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 PYTHONPATH=src \
        python bench/vllm_prefix.py --model HuggingFaceTB/SmolLM2-135M-Instruct

`--spider DIR` (Spider's dev.json and tables.json) measures instead what `evaluate --backend vllm` computes:
greedy answers to Spider's first `--n` dev questions (omnisql prompts from tables.json, as bench/evaluate.py's
shared-schema arms take them), through slmsql's own engine (`vllm_engine.load`, prefix caching set by the arm;
`vllm_engine.generate`, batches of `--batch-size` as evaluate sends them). Questions of one database share their
schema's blocks, so caching can skip a schema already prefilled by an earlier batch; vLLM counts those tokens per
request (`num_cached_tokens`), reported beside the seconds. The answers must be the same in every arm.

    env OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 PYTHONPATH=src python bench/vllm_prefix.py --arms off,on \
        --model HuggingFaceTB/SmolLM2-135M-Instruct --spider .cache/spider --n 40 --batch-size 8 --max-new-tokens 128

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


def spider_arm(args) -> dict:
    """Greedy answers to Spider's first --n dev questions as `evaluate --backend vllm` computes them."""
    from transformers import AutoTokenizer

    from slmsql import configs
    from slmsql.generation import vllm_engine
    from slmsql.inputs.data import read_gold
    from slmsql.inputs.prompts import PromptBuilder, render_prompt

    spider = Path(args.spider)
    tok = AutoTokenizer.from_pretrained(args.model)
    builder = PromptBuilder(spider / "no-databases", tables_json=spider / "tables.json", style="omnisql")
    prompts = [render_prompt(tok, builder.messages(e)) for e in read_gold(spider / "dev.json")[:args.n]]
    ids = tok(prompts, add_special_tokens=False).input_ids
    cfg = configs.load(configs.EvaluateConfig, None, {
        "model": args.model, "data": str(spider / "dev.json"), "db_root": str(spider), "backend": "vllm",
        "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens})
    engine, _ = vllm_engine.load(cfg, max(map(len, ids)), tok, enable_prefix_caching=args.arm != "off")
    cached = []
    generate = engine.llm.generate

    def counting(*a, **kw):  # vLLM's own count of each request's prompt tokens served from its cache
        out = generate(*a, **kw)
        cached.extend(r.num_cached_tokens or 0 for r in out)
        return out

    engine.llm.generate = counting
    kw = dict(k=1, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
              max_new_tokens=args.max_new_tokens, seed=0, batch_size=args.batch_size, progress=False)
    warm = ["Count the rows of a table.", "Name a SQL keyword."]  # shorter than a block: nothing cached
    vllm_engine.generate(engine, tok, warm, ["w0", "w1"], **{**kw, "max_new_tokens": 2})
    cached.clear()
    t0 = time.perf_counter()
    out = vllm_engine.generate(engine, tok, prompts, [str(i) for i in range(len(prompts))], **kw)
    seconds = time.perf_counter() - t0
    return {"seconds": round(seconds, 2), "prompt_tokens": sum(map(len, ids)), "cached_tokens": sum(cached),
            "answers": [o[0] for o in out]}


def arm(args) -> dict:
    if args.spider:
        return spider_arm(args)
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
    ap.add_argument("--spider", default="", help="Spider's folder (dev.json, tables.json): greedy evaluation's shape")
    ap.add_argument("--batch-size", type=int, default=8, help="with --spider: prompts per generate call")
    args = ap.parse_args(argv)
    if args.arm:
        print(json.dumps(arm(args)))
        return
    results = {}
    for name in args.arms.split(","):
        done = subprocess.run([sys.executable, __file__, "--arm", name, "--model", args.model, "--n", str(args.n),
                               "--k", str(args.k), "--max-new-tokens", str(args.max_new_tokens),
                               "--spider", args.spider, "--batch-size", str(args.batch_size)],
                              capture_output=True, text=True, timeout=1800)
        if done.returncode:
            sys.exit(f"arm {name} failed:\n{done.stderr[-3000:]}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[name]
        print(f"{name:5s} {r['seconds']:7.2f} s, " + (f"{r['cached_tokens']} of {r['prompt_tokens']} prompt tokens "
              "from the cache" if args.spider else f"{r['completion_tokens']} completion tokens"), flush=True)
    out = {"model": args.model, "n": args.n, "k": args.k, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
           "arms": results}
    if args.spider:
        out.update(k=1, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
        answers = [r.pop("answers") for r in results.values()]
        out["answers_differ"] = sum(len(set(a)) > 1 for a in zip(*answers))
    if {"off", "on"} <= set(results):
        out["caching_speedup"] = round(results["off"]["seconds"] / results["on"]["seconds"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
