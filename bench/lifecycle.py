"""The toy lifecycle, timed: `slmsql pipeline` in a temporary folder, step by step, beside a plain PyTorch loop.

Runs the whole pipeline (what `make demo` runs) as a subprocess with its own SQLite store and output folder,
watching its process tree and output folder, then reads the step runs back from the store. Per step: wall time
(the step's first process, the one carrying `--run-name <step>`, to its run's end) and start-up (that process's
start to the step's output folder appearing, `<step>.partial`, which a stage makes once its arguments and data
are checked and before it loads a model: the `mlflow run` launch, the imports, config and checks). Also: SFT tokens/s (TRL's `num_tokens`,
the non-padding tokens trained on, over `train_seconds`), GRPO seconds per optimizer step, evaluation questions
per second (per evaluation run, model load included), the peak resident memory (of the whole process tree, summed,
and of its largest process), and the headline EX figures (dev, SFT and GRPO).

Reference: a plain PyTorch loop (AdamW, forward, backward, step; no trainer) on the same model (the pipeline's
tiny model, as SFT started from it), the same data (the SFT rows, rendered and tokenized as TRL does: prompt
and completion through the chat template, loss on the completion) and the same batch shape (batch size,
right padding to the batch's longest row, max_length), for `--plain-steps` steps after warm-up; tokens/s counts
non-padding tokens. `sft_vs_plain` = SFT tokens/s / plain tokens/s.

    PYTHONPATH=src OMP_NUM_THREADS=1 python bench/lifecycle.py                  # the demo as is (~10 min on 2 cores)
    PYTHONPATH=src python bench/lifecycle.py --overrides "sft.max_steps=20 grpo.max_steps=2"   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("toy", "tiny-model", "sft", "filter", "grpo", "eval-sft-dev", "eval-grpo-dev", "eval-sft-dev_cross",
         "eval-grpo-dev_cross", "publish")


def run_pipeline(root: Path, overrides: str, poll_s: float = 0.2) -> dict:
    """`slmsql pipeline` into `root`; returns its wall time, exit code, log tail, peak RSS and, per step run
    name, when the first process carrying `--run-name <name>` started and when its output folder appeared."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db", "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_RUN_ID", None)
    cmd = [sys.executable, "-m", "slmsql.cli", "pipeline", "--output-dir", str(root / "outputs")]
    if overrides:
        cmd += ["--overrides", overrides]
    started = time.time()
    log = open(root / "pipeline.log", "w")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    top = psutil.Process(proc.pid)
    peak_tree = peak_one = 0
    step_start: dict[str, float] = {}
    step_work: dict[str, float] = {}
    out = root / "outputs"
    while proc.poll() is None:
        for name in STEPS:
            if name not in step_work and ((out / f"{name}.partial").exists() or (out / name).exists()):
                step_work[name] = time.time()
        try:
            procs = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        rss = []
        for p in procs:
            try:
                rss.append(p.memory_info().rss)
                args = p.cmdline()
                if "--run-name" in args:
                    name = args[args.index("--run-name") + 1]
                    step_start[name] = min(step_start.get(name, float("inf")), p.create_time())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, IndexError):
                pass
        peak_tree, peak_one = max(peak_tree, sum(rss)), max([peak_one, *rss])
        time.sleep(poll_s)
    log.close()
    return {"rc": proc.returncode, "wall_s": time.time() - started, "step_start": step_start, "step_work": step_work,
            "peak_rss_mb": peak_tree / 2**20, "peak_rss_one_process_mb": peak_one / 2**20,
            "log_tail": (root / "pipeline.log").read_text()[-3000:]}


def step_figures(root: Path, watched: dict) -> tuple[dict, dict, object]:
    """Per step: wall and start-up seconds, from the processes and folders seen and the step runs' end times."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{root}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("slmsql.stage") == "pipeline"]
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    steps, previous_end = {}, parent.info.start_time / 1000
    for name in STEPS:
        run = children[name]
        end = run.info.end_time / 1000
        launched = watched["step_start"].get(name, previous_end)  # a step too quick to be seen: from the last end
        work = watched["step_work"].get(name)
        steps[name] = {"wall_s": round(end - launched, 2),
                       "startup_s": round(work - launched, 2) if work is not None else None}
        previous_end = end
    return steps, children, parent


def collate(batch: list[tuple[list[int], int]], pad: int):
    """(token ids, prompt length) rows -> input ids right-padded to the longest row, attention mask, and labels
    (-100 on prompt and padding: the loss falls on the completion, as TRL's completion-only loss)."""
    import torch

    width = max(len(row) for row, _ in batch)
    ids = torch.full((len(batch), width), pad)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100)
    for i, (row, n_prompt) in enumerate(batch):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
        labels[i, n_prompt:len(row)] = ids[i, n_prompt:len(row)]
    return ids, mask, labels


def plain_loop(root: Path, sft_run, steps: int, warmup: int = 3) -> dict:
    """The reference training loop on the SFT step's model, data and batch shape (module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slmsql import configs
    from slmsql.inputs.data import read_gold
    from slmsql.stages.sft import conversations

    fields = {f for f in configs.SFTStageConfig.__dataclass_fields__}
    params = {k: v for k, v in sft_run.data.params.items() if k in fields}
    world = root / "outputs" / "toy"
    cfg = configs.load(configs.SFTStageConfig, None, {**params, "data": str(world / "sft.jsonl"),
                                                        "db_root": str(world / "databases"),
                                                        "model": str(root / "outputs" / "tiny-model")})
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    rows = []
    for row in conversations(cfg, read_gold(cfg.data)):  # as TRL tokenizes conversational prompt-completion rows
        prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True,
                                               return_dict=False)
        full = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=True, return_dict=False)
        rows.append((list(full)[:cfg.max_length], len(prompt)))
    B, pad = cfg.per_device_train_batch_size, tokenizer.pad_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    rng = random.Random(0)
    model.train()
    tokens, seconds = 0, 0.0
    for step in range(warmup + steps):
        ids, mask, labels = collate(rng.sample(rows, B), pad)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            seconds += time.perf_counter() - t0
            tokens += int(mask.sum())
    return {"steps": steps, "batch_size": B, "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1), "threads": torch.get_num_threads()}


def last(client, run, key):
    history = client.get_metric_history(run.info.run_id, key)
    return max(history, key=lambda m: m.step).value if history else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--overrides", default="", help="slmsql pipeline --overrides (default: the demo as is)")
    ap.add_argument("--plain-steps", type=int, default=100, help="steps of the plain PyTorch loop")
    ap.add_argument("--keep", default="", help="run in this folder and keep it (default: a temporary one)")
    args = ap.parse_args()

    import mlflow

    with tempfile.TemporaryDirectory(prefix="slmsql-lifecycle-") as tmp:
        root = Path(args.keep or tmp).resolve()
        root.mkdir(parents=True, exist_ok=True)
        watched = run_pipeline(root, args.overrides)
        if watched["rc"] != 0:
            print(watched["log_tail"], file=sys.stderr)
            print(f"slmsql pipeline exited with {watched['rc']}", file=sys.stderr)
            return 1
        steps, runs, parent = step_figures(root, watched)
        client = mlflow.MlflowClient(f"sqlite:///{root}/mlflow.db")
        sft, grpo = runs["sft"].data.metrics, runs["grpo"].data.metrics
        sft_tokens = last(client, runs["sft"], "num_tokens")
        evals = {name: runs[name] for name in STEPS if name.startswith("eval-")}
        fig = {
            "pipeline_wall_s": round(watched["wall_s"], 1),
            "steps": steps,
            "sft": {"steps": sft["steps"], "train_seconds": round(sft["train_seconds"], 1), "non_padding_tokens": sft_tokens,
                    "tokens_per_s": round(sft_tokens / sft["train_seconds"], 1) if sft_tokens else None},
            "grpo": {"steps": grpo["steps"], "train_seconds": round(grpo["train_seconds"], 1),
                     "s_per_step": round(grpo["train_seconds"] / grpo["steps"], 2)},
            "evaluate_questions_per_s": {
                name: round(r.data.metrics["n"] / ((r.info.end_time - r.info.start_time) / 1000), 2)
                for name, r in evals.items()},
            "peak_rss_mb": round(watched["peak_rss_mb"]), "peak_rss_one_process_mb": round(watched["peak_rss_one_process_mb"]),
            "ex": {"sft_dev": parent.data.metrics.get("eval-sft-dev/ex"),
                   "grpo_dev": parent.data.metrics.get("eval-grpo-dev/ex"),
                   "sft_dev_cross": parent.data.metrics.get("eval-sft-dev_cross/ex"),
                   "grpo_dev_cross": parent.data.metrics.get("eval-grpo-dev_cross/ex")},
            "overrides": args.overrides, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "load_avg_1m": round(os.getloadavg()[0], 2),
        }
        fig["plain_loop"] = plain_loop(root, runs["sft"], args.plain_steps)
        if fig["sft"]["tokens_per_s"]:
            fig["sft_vs_plain"] = round(fig["sft"]["tokens_per_s"] / fig["plain_loop"]["tokens_per_s"], 3)

    print(f"pipeline {fig['pipeline_wall_s']:.0f} s, peak RSS {fig['peak_rss_mb']} MB "
          f"(largest process {fig['peak_rss_one_process_mb']} MB)")
    for name, s in steps.items():
        print(f"  {name:20s} {s['wall_s']:7.1f} s  (start-up {s['startup_s']} s)")
    print(f"SFT {fig['sft']['tokens_per_s']} tokens/s vs plain loop {fig['plain_loop']['tokens_per_s']} "
          f"(x{fig.get('sft_vs_plain')}); GRPO {fig['grpo']['s_per_step']} s/step; EX dev SFT {fig['ex']['sft_dev']}, "
          f"GRPO {fig['ex']['grpo_dev']}")
    print(json.dumps(fig))
    return 0


if __name__ == "__main__":
    sys.exit(main())
