"""Filter throughput: the local engine vs the Ray engine with 1 and 2 workers, on the same toy questions.

Builds its own toy world (`slmsql.toy.world`) and, unless `--model` is given, the embedded tiny model
(untrained: it almost never emits its end token, so every completion runs to `--max-new-tokens` and nearly
none holds SQL: the work is generation-bound, like the real filter on GPUs; pass a trained policy, e.g.
`--model outputs/sft` after `make demo`, for completions that execute). Then it runs the filter's engine
(`slmsql.generation.engines.run` with the filter's work, exactly what `slmsql filter` runs between reading its input
and bucketing; not the MLflow logging and data check around it, the same for every engine) on `--n`
rl_source questions with K = `--k`, once per arm:

- `local`: this process generates chunk by chunk, one sandbox worker scores (`--workers 1`).
- `rayN`: an in-process local Ray (started once, `num_cpus` = 2 x the largest N, logical CPUs) with N
  generation actors and N scoring actors (1 CPU each, one sandbox worker each): `--engine ray`.

Every arm must give the same passrates rows (samples are seeded by question id): exit 1 otherwise.
Reported per arm: wall seconds of the engine run (every arm starts its own sandbox pools and loads the model;
Ray arms also start their actors, but not Ray itself: `ray.init` and a first one-actor dataset that starts
Ray Data's helpers are reported apart as `ray_init_s` and `ray_warmup_s`),
questions/s, samples scored/s (n x K / wall), and the ratio to local (local seconds / arm seconds: above 1 is
faster). For the local arm, its time split between generation and scoring (the pool's start included).

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/filter_scale.py [--n 64] [--k 8] [--arms local,ray1,ray2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate import build_world  # noqa: E402  (the toy world + tiny model, as bench/evaluate.py builds them)

from slmsql import configs
from slmsql.generation import engines  # noqa: E402
from slmsql.inputs.data import dumps, read_gold, read_jsonl, write_jsonl  # noqa: E402
from slmsql.sql.passrates import CHUNK  # noqa: E402


class _Identity:
    def __call__(self, batch):
        return batch


def timed_local_split():
    """Wrap the engine's generate and score steps (they run in this process on the local engine)."""
    spent = {"generate": 0.0, "score": 0.0}
    for name in spent:
        inner = getattr(engines.Work, name)

        def wrapper(self, *a, _inner=inner, _name=name, **kw):
            t = time.perf_counter()
            try:
                return _inner(self, *a, **kw)
            finally:
                spent[_name] += time.perf_counter() - t

        setattr(engines.Work, name, wrapper)
    return spent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=64, help="source questions")
    ap.add_argument("--k", type=int, default=8, help="samples per question")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16, help="prompts per generation batch (every arm)")
    ap.add_argument("--arms", default="local,ray1,ray2")
    ap.add_argument("--model", default="", help="a policy to load instead of the untrained tiny model")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a != "local" and not (a.startswith("ray") and a[3:].isdigit() and int(a[3:]) > 0)]
    if bad:
        ap.error(f"unknown arms {bad} (use local and rayN)")

    root = Path(tempfile.mkdtemp(prefix="filter-scale-"))
    toy, model = build_world(root, args.model, args.seed)
    source = read_jsonl(toy / "rl_source.jsonl")[: args.n]
    write_jsonl(root / "source.jsonl", source)
    base = {"data": str(root / "source.jsonl"), "db_root": str(toy / "databases"), "model": model, "k": args.k,
            "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "workers": 1,
            "seed": args.seed}
    examples = read_gold(root / "source.jsonl")
    n, samples = len(examples), len(examples) * args.k

    figures, rows, ray_init_s, ray_warmup_s, split = {}, {}, None, None, None
    for arm in arms:
        over = {}
        if arm.startswith("ray"):
            workers = int(arm[3:])
            if ray_init_s is None:
                import ray

                t = time.perf_counter()
                ray.init(num_cpus=2 * max(int(a[3:]) for a in arms if a.startswith("ray")), include_dashboard=False,
                         _temp_dir=tempfile.mkdtemp(prefix="ray", dir="/tmp"))
                ray_init_s = time.perf_counter() - t
                # Ray Data's first dataset starts its own helper actors: once per Ray, not per run
                t = time.perf_counter()
                ray.data.range(4).map_batches(_Identity, compute=ray.data.ActorPoolStrategy(size=1)).take_all()
                ray_warmup_s = time.perf_counter() - t
            over.update(engine="ray", ray_generators=workers, ray_scorers=workers, ray_score_batch=16)
        elif split is None:
            split = timed_local_split()
        got = {}
        t = time.perf_counter()
        engines.run(engines.Work("filter", configs.load(configs.FilterConfig, None, {**base, **over})), examples,
                    lambda items: got.update((e.id, row) for e, _, row in items), chunk=CHUNK)
        wall = time.perf_counter() - t
        rows[arm] = "".join(dumps(got[e.id]) + "\n" for e in examples)
        figures[arm] = {"seconds": round(wall, 3), "questions_per_s": round(n / wall, 3),
                        "samples_scored_per_s": round(samples / wall, 2)}
        print(f"{arm:>6}: {wall:7.2f} s  {n / wall:7.2f} questions/s  {samples / wall:8.1f} samples scored/s",
              flush=True)

    identical = len(set(rows.values())) == 1
    statuses: dict[str, int] = {}
    for r in map(json.loads, next(iter(rows.values())).splitlines()):
        for s in r.get("statuses", []):
            statuses[s] = statuses.get(s, 0) + 1
    if "local" in figures:
        for arm in figures:
            figures[arm]["ratio_to_local"] = round(figures["local"]["seconds"] / figures[arm]["seconds"], 3)
    result = {"n": n, "k": args.k, "samples": samples, "max_new_tokens": args.max_new_tokens,
              "batch_size": args.batch_size, "model": args.model or "tiny (untrained)", "arms": figures,
              "ray_init_s": None if ray_init_s is None else round(ray_init_s, 2),
              "ray_warmup_s": None if ray_warmup_s is None else round(ray_warmup_s, 2), "identical_outputs": identical,
              "sample_statuses": statuses, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "cpus": os.cpu_count()}
    if split is not None:
        result["local_split"] = {"generate_s": round(split["generate"], 3), "score_s": round(split["score"], 3),
                                 "generate_s_per_question": round(split["generate"] / n, 4),
                                 "score_ms_per_sample": round(1e3 * split["score"] / samples, 3)}
    if ray_init_s is not None:
        import ray

        ray.shutdown()
    print("identical passrates rows across arms:", identical)
    print(json.dumps(result))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
