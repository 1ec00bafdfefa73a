"""GRPO seconds per step, transformers vs vLLM rollouts (`slmsql grpo --backend`), in one run, on identical work.

Model and shape: `make demo-real`'s GRPO, recipes/smollm2-135m/grpo.yaml on SmolLM2-135M-Instruct (LoRA r16
all-linear, 2 prompts x K=4 completions of up to 64 tokens per step, gradient checkpointing), with a fresh LoRA (the
demo continues its SFT adapter: same rank, same work per step) on the toy world's first rl_source questions. Each
backend runs the grpo stage itself (slmsql.stages.grpo.main) for `--warmup` + `--steps` optimizer steps, same seed.
Per step: step (wall clock from one optimizer step's end to the next), generate (TRL's `_generate`: the rollout,
i.e. transformers' generate, or the LoRA save + new LoRARequest + vLLM's sampling, and decoding), score (the rest
of `_generate_and_score_completions`: rewards, and on vLLM the policy's log-probs of the rollouts for TRL's
importance-sampling correction and gap metric), train (step - generate - score: forward + backward, optimizer).
Medians over the timed steps; the warm-up steps take the vLLM engine's start. Sampled completions differ between
backends (different random streams), so completion tokens per step are reported beside the times.

    flock /tmp/slmsql-cpu.lock env OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 PYTHONPATH=src python bench/grpo_backends.py

The last printed line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # grpo_gpu's Clock
RECIPE = ROOT / "recipes" / "smollm2-135m" / "grpo.yaml"


def toy_questions(root: Path, n: int = 64) -> None:
    """The toy world at root/toy and its first n rl_source questions at root/rl.jsonl (the benches' GRPO data)."""
    from slmsql.toy import world as toyworld

    toyworld.generate(root / "toy", seed=0, size="small")
    questions = (root / "toy" / "rl_source.jsonl").read_text().splitlines(keepends=True)
    (root / "rl.jsonl").write_text("".join(questions[:n]))


def run(label: str, overrides: dict, args, root: Path, inputs_hook=None) -> dict:
    """The grpo stage for `--warmup` + `--steps` steps with the recipe and `overrides`; per-step medians.
    `inputs_hook(inputs)` sees every micro-batch the loss is computed on (bench/grpo_prefix.py counts tokens)."""
    import mlflow
    from transformers.trainer_callback import CallbackHandler
    from trl import GRPOTrainer

    from slmsql import configs
    from slmsql.stages import grpo

    from grpo_gpu import Clock  # its per-step buckets, driven here by the stage's own trainer

    clock = Clock(cuda=False)
    saved = {name: getattr(GRPOTrainer, name) for name in ("_generate", "_generate_and_score_completions",
                                                              "_compute_loss")}
    on_begin, on_end = CallbackHandler.on_train_begin, CallbackHandler.on_step_end

    step_clock = clock.callback()

    def begin(self, args, state, control):
        step_clock.on_train_begin(args, state, control)  # the first step starts here (model loaded, trainer built)
        return on_begin(self, args, state, control)

    def end(self, args, state, control):
        step_clock.on_step_end(args, state, control)
        return on_end(self, args, state, control)

    GRPOTrainer._generate = clock.wrap(saved["_generate"], "generate")
    GRPOTrainer._generate_and_score_completions = clock.wrap(saved["_generate_and_score_completions"],
                                                             "generate_and_score")
    if inputs_hook is not None:
        def compute_loss(self, model, inputs):
            inputs_hook(inputs)
            return saved["_compute_loss"](self, model, inputs)

        GRPOTrainer._compute_loss = compute_loss
    CallbackHandler.on_train_begin, CallbackHandler.on_step_end = begin, end
    cfg = configs.load(configs.GRPOStageConfig, str(args.recipe), {
        "data": str(root / "rl.jsonl"), "db_root": str(root / "toy" / "databases"),
        "output_dir": str(root / f"grpo-{label}"), "max_steps": args.warmup + args.steps, "save_steps": 1000,
        "completions_every": 1000, "workers": 1, "seed": args.seed, **({"model": args.model} if args.model else {}),
        **overrides})
    try:
        summary = grpo.main(cfg)
    finally:
        for name, fn in saved.items():
            setattr(GRPOTrainer, name, fn)
        CallbackHandler.on_train_begin, CallbackHandler.on_step_end = on_begin, on_end
    run_id = mlflow.search_runs(search_all_experiments=True, output_format="list",
                                order_by=["start_time DESC"])[0].info.run_id
    lengths = [h.value for h in sorted(mlflow.MlflowClient().get_metric_history(run_id, "completions/mean_length"),
                                       key=lambda h: h.step)]
    gap = [h.value for h in mlflow.MlflowClient().get_metric_history(run_id, "sampling/sampling_logp_difference/max")]
    timed = [{"step": s["step"], "generate": s["generate"], "score": s["generate_and_score"] - s["generate"],
              "train": s["step"] - s["generate_and_score"]} for s in clock.steps[args.warmup:]]
    med = {k: round(statistics.median(s[k] for s in timed), 3) for k in timed[0]}
    completions = cfg.per_device_train_batch_size
    tokens = [round(x * completions) for x in lengths[args.warmup:]]
    return {"step_s": med["step"], "generate_s": med["generate"], "score_s": med["score"], "train_s": med["train"],
            "step_s_all": [round(s["step"], 2) for s in clock.steps],
            "generate_s_all": [round(s["generate"], 2) for s in clock.steps],
            "completion_tokens_per_step": tokens,
            "generate_tokens_per_s": round(statistics.median(tokens) / med["generate"], 1),
            "logp_gap_max": max(gap) if gap else None, "steps": summary["steps"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="transformers,vllm")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per backend")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (the vLLM engine starts in the first)")
    ap.add_argument("--recipe", type=Path, default=RECIPE)
    ap.add_argument("--model", default="", help="another model than the recipe's (tests: a tiny one)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    import transformers
    import trl

    from slmsql.generation import vllm_engine

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    results = {}
    with tempfile.TemporaryDirectory(prefix="slmsql-bench-grpo-backends-") as tmp:
        root = Path(tmp)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root}/mlflow.db"
        toy_questions(root)
        print(f"{args.recipe.relative_to(ROOT) if args.recipe.is_relative_to(ROOT) else args.recipe}: "
              f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers "
              f"{transformers.__version__}, trl {trl.__version__}, vLLM {vllm_engine.version() or 'none'}; "
              f"{args.warmup} warm-up + {args.steps} timed steps per backend", flush=True)
        for backend in backends:
            results[backend] = r = run(backend, {"backend": backend}, args, root)
            print(f"{backend:12s} step {r['step_s']:7.2f} s = generate {r['generate_s']:.2f} + score "
                  f"{r['score_s']:.2f} + train {r['train_s']:.2f}; {r['generate_tokens_per_s']:.0f} generated tok/s; "
                  f"completion tokens/step {r['completion_tokens_per_step']}", flush=True)
    ratios = {}
    if {"transformers", "vllm"} <= set(results):
        t, v = results["transformers"], results["vllm"]
        ratios = {"step_vllm_over_transformers": round(v["step_s"] / t["step_s"], 2),
                  "generate_vllm_over_transformers": round(v["generate_s"] / t["generate_s"], 2)}
        print(f"vLLM / transformers: step {ratios['step_vllm_over_transformers']}x, generate "
              f"{ratios['generate_vllm_over_transformers']}x")
    print(json.dumps({"recipe": str(args.recipe.name), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                      "torch_threads": torch.get_num_threads(), "vllm": vllm_engine.version(),
                      "warmup": args.warmup, "steps": args.steps, "backends": results, "ratios": ratios}))
    return results


if __name__ == "__main__":
    main()
