"""GRPO seconds per step with the shared prefix on and off (`slmsql grpo --shared-prefix`), in one run, same work;
as arm `merged`, the shared prefix with the rollouts sampled merged (`--merged-rollouts`); as arm `vllm`, the shared
prefix with vLLM's rollouts (`--backend vllm`).

Model and shape: SmolLM2-135M-Instruct by its Hub id at the SmolLM2 study's GRPO (recipes/smollm2-135m/grpo.yaml:
LoRA r16 all-linear, gradient checkpointing, G = 4, 2 prompts a step, 64-token budget, compact prompts) on the toy
world's first rl_source questions; `--prompt-style`, `--example-values`, `--num-generations` and
`--max-completion-length` change the shape (2 prompts a step: the batch is 2 x G; the seed's shape is omnisql
prompts with 3 example values, G = 8, 256-token completions: bench/README.md has the command). Each arm runs the
grpo stage itself (bench/grpo_backends.py's `run`) for `--warmup` + `--steps` steps, same seed; medians over the
timed steps of step, generate and train (as grpo_backends defines them). Sampled completions differ between the
arms after the first step (the prefill's float order), so the tokens each arm computed are reported beside its
times, and the speed-ups are ratios of times per step.

Arms: `shared` is `--shared-prefix true` as a run decides it (on, or TRL's path where the first step's cost model
puts the packed forward above the plain one: its tag, `shared_prefix/cost_ratio` and whether it ran packed are
reported); `packed` is the same with the cost model off (shared_prefix_trainer.COST_MODEL), to time what
the cost model turns down; `plain` is `--shared-prefix false`; `merged` is `shared` with `--merged-rollouts`;
`vllm` is `shared` with `--backend vllm` (its generate: the LoRA saved and served as a new LoRARequest, and vLLM's
sampling; its score adds the policy's log-probs of the rollouts, which TRL takes under vLLM).

Tokens: per micro-batch the loss saw, `plain` = rows x width (what TRL's forward computes, padding included) and
`shared` = the packed layout's tokens (shared_prefix.Packing); `token_ratio` = plain / shared, the bound a perfect
implementation reaches on the training forward. FLOP floor: the weights' matmul FLOPs of the step (training
forward 2NT + input-gradient backward 2NT + the checkpointing recompute 2NT, N the decoder's linear weights; the
LM head 2Vd per scored or generated token, x3 in training; generation: the prefill of each distinct prompt and every
decoded token) over this machine's measured fp32 GEMM rate at the same thread count: a floor, not a prediction
(attention and everything else is left out).

    flock /tmp/slmsql-cpu.lock env OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 PYTHONPATH=src python bench/grpo_prefix.py

Merged rollouts beside the shared prefix (the same steps, only the rollouts' LoRA merged; `merged_over_shared`:
the shared arm's seconds over the merged arm's, and the merged arm's first-rollout log-prob gap):

    flock /tmp/slmsql-cpu.lock env OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 PYTHONPATH=src python bench/grpo_prefix.py \
        --arms shared,merged --warmup 2

(2 warm-up steps: a fresh LoRA's gap is measured at step 1's rollout.) Which rollouts a cell should use, the
transformers ones merged or vLLM's (each with the shared prefix; `vllm_over_merged`: the merged arm's seconds over
the vLLM arm's, so above 1 means vLLM is faster; needs vllm, the first warm-up step starts its engine):

    flock /tmp/slmsql-cpu.lock env OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 PYTHONPATH=src python bench/grpo_prefix.py \
        --arms merged,vllm --warmup 2

The last printed line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
RECIPE = ROOT / "recipes" / "smollm2-135m" / "grpo.yaml"


def gemm_rate(hidden: int, inner: int, rows: int = 2048) -> float:
    """This machine's best fp32 FLOP/s on a training-shaped matmul (rows x hidden x inner), after a warm-up (the
    first calls start OpenMP's threads and were measured 4x slower here)."""
    import torch

    a, b = torch.randn(rows, hidden), torch.randn(hidden, inner)
    for _ in range(10):
        torch.mm(a, b)
    best = float("inf")
    for _ in range(50):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * rows * hidden * inner / best


class Tokens:
    """What the loss's micro-batches hold: rows x width, the packed layout's tokens, prompt and completion tokens."""

    def __init__(self):
        self.steps: list[dict] = []

    def __call__(self, inputs):
        import torch

        from slmsql.generation.shared_prefix import Packing

        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        keep = inputs["completion_ids"].size(1)
        packing = Packing.of(ids, mask, keep)
        distinct = {tuple(r[m.bool()].tolist()) for r, m in zip(inputs["prompt_ids"], inputs["prompt_mask"])}
        self.steps.append({"plain": ids.numel(), "shared": packing.tokens if packing else ids.numel(),
                           "prompt": int(inputs["prompt_mask"].sum()), "distinct_prompt": sum(map(len, distinct)),
                           "completion": int(inputs["completion_mask"].sum()), "rows": ids.size(0)})


def floor_seconds(t: dict, packed: bool, shape: dict, rate: float, checkpointing: bool) -> dict:
    """The weights' matmul FLOPs of one step's micro-batches, packed or not, over `rate` (module docstring)."""
    n, head = shape["linear_params"], shape["vocab"] * shape["hidden"]
    computed = t["shared"] if packed else t["plain"]
    train = (6 if checkpointing else 4) * n * computed + 3 * 2 * head * t["completion"]
    prefill = t["distinct_prompt"] if packed else t["prompt"]
    generate = 2 * n * (prefill + t["completion"]) + 2 * head * t["completion"]
    return {"train": train / rate, "generate": generate / rate}


def merged_gap() -> float | None:
    """The last run's first-rollout log-prob gap, merged vs the training forward (rollout/merged_logprob_gap)."""
    import mlflow

    from slmsql.generation.merged_rollouts import METRIC

    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list", order_by=["start_time DESC"],
                                max_results=1)
    return run.data.metrics.get(METRIC)


def prefix_state(arm: str) -> dict:
    """The arm's run as the shared prefix left it (the newest run in the store): its tag, the cost model's figure
    (plain over packed forward FLOPs on the first micro-batch) and whether it ran packed."""
    import mlflow

    from slmsql.training import shared_prefix_trainer

    run = mlflow.search_runs(search_all_experiments=True, output_format="list", order_by=["start_time DESC"])[0]
    tag = run.data.tags.get(shared_prefix_trainer.TAG, "")
    cost = run.data.metrics.get("shared_prefix/cost_ratio")
    return {"tag": tag, "cost_ratio": None if cost is None else round(cost, 2), "ran_packed": tag.startswith("on: ")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per arm")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (the shared arm's self-check)")
    ap.add_argument("--recipe", type=Path, default=RECIPE)
    ap.add_argument("--model", default="", help="another model than the recipe's (tests: a tiny one)")
    ap.add_argument("--prompt-style", default="", help="compact or omnisql (default: the recipe's)")
    ap.add_argument("--example-values", type=int, default=None, help="omnisql example values per column")
    ap.add_argument("--num-generations", type=int, default=0, help="G (default: the recipe's); 2 prompts a step")
    ap.add_argument("--max-completion-length", type=int, default=0, help="completion budget (default: the recipe's)")
    ap.add_argument("--arms", default="shared,plain",
                    help="of shared, packed (cost model off), plain, merged (shared + merged rollouts) and vllm "
                         "(shared + vLLM rollouts)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if unknown := sorted(set(arms) - {"shared", "packed", "plain", "merged", "vllm"}):
        ap.error(f"--arms: unknown {unknown} (shared, packed, plain, merged, vllm)")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    import transformers
    import trl
    from grpo_backends import run, toy_questions

    from slmsql import configs
    from slmsql.policy.models import load_tokenizer
    from slmsql.training import shared_prefix_trainer

    overrides = {k: v for k, v in (("prompt_style", args.prompt_style), ("example_values", args.example_values))
                 if v not in ("", None)}
    if args.num_generations:
        overrides.update(num_generations=args.num_generations, per_device_train_batch_size=2 * args.num_generations)
    if args.max_completion_length:
        overrides.update(max_completion_length=args.max_completion_length)
    cfg = configs.load(configs.GRPOStageConfig, str(args.recipe), {**overrides,
                                                                  **({"model": args.model} if args.model else {})})
    checkpointing = bool(cfg.trainer_args.get("gradient_checkpointing"))
    config = transformers.AutoConfig.from_pretrained(cfg.model)
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    linear = layers * (hidden * head_dim * (heads + 2 * kv) + heads * head_dim * hidden
                       + 3 * hidden * config.intermediate_size)
    shape = {"linear_params": linear, "vocab": config.vocab_size, "hidden": hidden}
    rate = gemm_rate(hidden, config.intermediate_size)
    load_tokenizer(cfg.model)  # fail before any arm runs if the model is not there
    results, tokens = {}, {}
    micro = cfg.gradient_accumulation_steps  # micro-batches the loss sees per optimizer step
    with tempfile.TemporaryDirectory(prefix="slmsql-bench-grpo-prefix-") as tmp:
        root = Path(tmp)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root}/mlflow.db"
        toy_questions(root)
        print(f"{cfg.model}: G {cfg.num_generations}, {cfg.per_device_train_batch_size * micro} completions a step, "
              f"{cfg.max_completion_length}-token budget, {cfg.prompt_style} prompts ({cfg.example_values} example "
              f"values), gradient checkpointing {checkpointing}; torch {torch.__version__} "
              f"({torch.get_num_threads()} threads), trl {trl.__version__}; fp32 GEMM {rate / 1e9:.1f} GFLOP/s; "
              f"{args.warmup} warm-up + {args.steps} timed steps per arm", flush=True)
        for arm in arms:
            counter = Tokens()
            shared_prefix_trainer.COST_MODEL = arm != "packed"
            try:
                r = run(arm, {**overrides, "shared_prefix": arm != "plain", "merged_rollouts": arm == "merged",
                              "backend": "vllm" if arm == "vllm" else "transformers"}, args, root, inputs_hook=counter)
            finally:
                shared_prefix_trainer.COST_MODEL = True
            r.update(prefix_state(arm))
            if arm == "merged":
                r["merged_logprob_gap"] = merged_gap()
            packed = r["ran_packed"]
            # a micro-batch's median (one a step at gradient_accumulation_steps 1) times a step's micro-batches
            timed = counter.steps[args.warmup * micro:]
            t = {k: round(statistics.median(s[k] for s in timed)) * micro for k in timed[0]}
            floor = floor_seconds(t, packed, shape, rate, checkpointing)
            r.update(tokens=t, floor_train_s=float(f"{floor['train']:.3g}"),
                     floor_generate_s=float(f"{floor['generate']:.3g}"))
            results[arm], tokens[arm] = r, t
            print(f"{arm:7s} step {r['step_s']:6.2f} s = generate {r['generate_s']:.2f} + score {r['score_s']:.2f} + "
                  f"train {r['train_s']:.2f}; floor: train {r['floor_train_s']:.2f}, generate "
                  f"{r['floor_generate_s']:.2f}; tokens/step: rows x width {t['plain']}, computed "
                  f"{t['shared'] if packed else t['plain']}, prompt {t['prompt']} ({t['distinct_prompt']} "
                  f"distinct), completion {t['completion']}" + (f"; {r['tag']}" if r["tag"] else ""), flush=True)
    out = {"model": cfg.model, "num_generations": cfg.num_generations, "prompt_style": cfg.prompt_style,
           "example_values": cfg.example_values, "max_completion_length": cfg.max_completion_length,
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
           "gemm_gflops": round(rate / 1e9, 1), "warmup": args.warmup, "steps": args.steps, "arms": results}
    for arm in [a for a in ("shared", "packed") if a in results and "plain" in results]:
        s, p = results[arm], results["plain"]
        prefix = "" if arm == "shared" else "packed_"  # the shared arm's keys as they were before the packed arm
        out.update({f"{prefix}step_speedup": round(p["step_s"] / s["step_s"], 2),
                    f"{prefix}train_speedup": round(p["train_s"] / s["train_s"], 2),
                    f"{prefix}generate_speedup": round(p["generate_s"] / s["generate_s"], 2),
                    f"{prefix}token_ratio": round(tokens[arm]["plain"] / tokens[arm]["shared"], 2),
                    f"{arm}_train_over_floor": round(s["train_s"] / s["floor_train_s"], 1)})
        print(f"{arm} / plain: step {out[f'{prefix}step_speedup']}x, train {out[f'{prefix}train_speedup']}x, "
              f"generate {out[f'{prefix}generate_speedup']}x; token ratio {out[f'{prefix}token_ratio']}; "
              f"cost model {s['cost_ratio']}; {arm} train at {out[f'{arm}_train_over_floor']}x its floor")
    if {"shared", "merged"} <= set(results):
        s, m = results["shared"], results["merged"]
        out["merged_over_shared"] = {k: round(s[f"{k}_s"] / m[f"{k}_s"], 2) for k in ("step", "generate", "train")}
        print(f"shared / merged: step {out['merged_over_shared']['step']}x, generate "
              f"{out['merged_over_shared']['generate']}x, train {out['merged_over_shared']['train']}x; merged "
              f"rollouts' log-prob gap {m['merged_logprob_gap']}")
    if {"merged", "vllm"} <= set(results):
        m, v = results["merged"], results["vllm"]
        out["vllm_over_merged"] = {k: round(m[f"{k}_s"] / v[f"{k}_s"], 2) for k in ("step", "generate", "train")}
        print(f"merged / vllm: step {out['vllm_over_merged']['step']}x, generate {out['vllm_over_merged']['generate']}x"
              f", train {out['vllm_over_merged']['train']}x; vLLM's largest log-prob gap {v['logp_gap_max']}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
