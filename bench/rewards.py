"""What each registered reward costs per completion, called as TRL calls them in a GRPO step.

Builds its own toy world (`slmsql.toy.world`, small) and, for `--questions` of its dev questions, `--k` completions
each (a GRPO batch of questions x K): per question a fixed mix of the gold itself, the gold with its first
table aliased (`AS t0`: a join's `table.column` then fails, as a model's slip would), the gold with its last
literal changed, `SELECT *` of the gold's first table, the gold cut in half (a truncated completion), the gold
with its first select word misspelled, no SQL at all, and the gold again as bare SQL, cycled to K. Every
completion in a ```sql block but the last two kinds.

Each batch calls every reward once, in the registry's order, through `rewards.build` (one shared execution: the
execution reward runs the batch's SQL on a `SandboxPool`; the cell rewards then read its results, so their cost is
the comparison alone; `executions` counts the batches the pool actually ran, which equals `batches` when they
share). The SQL-text caches (sqlsim's parses and bigrams) are cleared before each batch, so every completion is
parsed cold, as new samples are in training; a gold is parsed once per batch and found again for its K samples.
Figures: ms per completion for each reward (wall time of its call / completions), the median over `--repeats`
passes over all batches, and the sum. `cell_precision_alone` is the same measure with no execution to share
(what it costs without the execution reward in the set).

    PYTHONPATH=src python bench/rewards.py [--questions 64] [--k 8] [--batch-questions 8] [--repeats 3]
        [--workers 2] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from slmsql.rewards import registry as rewards, sqlsim
from slmsql.inputs.data import db_path, read_gold
from slmsql.sql.sandbox import Limits, SandboxPool
from slmsql.toy.world import generate as make_toy


def variants(gold: str) -> list[str]:
    """The completion kinds of the module docstring, for one gold SQL."""
    first = re.search(r"\bFROM\s+(\w+)", gold, re.I)
    table = first.group(1) if first else "t"
    alias = re.sub(rf"\bFROM\s+{table}\b", f"FROM {table} AS t0", gold, count=1, flags=re.I)
    literal = re.sub(r"('[^']*'|\b\d+\b)(?!.*('[^']*'|\b\d+\b))", "'zz'", gold, flags=re.S)
    misspelled = re.sub(r"^SELECT\s+(\w+)", lambda m: f"SELECT {m.group(1)}x", gold, count=1, flags=re.I)
    fenced = [gold, alias, literal, f"SELECT * FROM {table}", gold[: len(gold) // 2], misspelled]
    return [f"```sql\n{s}\n```" for s in fenced] + ["I cannot answer that.", gold]


def batches(examples, root: Path, k: int, per_batch: int):
    rows = [(e, c) for e in examples for c in (variants(e.sql) * k)[:k]]
    size = per_batch * k
    for i in range(0, len(rows), size):
        chunk = rows[i:i + size]
        yield [c for _, c in chunk], {"sql": [e.sql for e, _ in chunk],
                                      "db_path": [str(db_path(root, e.db_id)) for e, _ in chunk]}


def timed_pass(names, work, executor) -> tuple[dict[str, float], int]:
    """One pass over every batch: seconds spent in each reward, and the batches the pool ran."""
    spent, ran = dict.fromkeys(names, 0.0), 0
    for completions, cols in work:
        sqlsim.parse.cache_clear()
        sqlsim.bigrams.cache_clear()
        shared = rewards.Executions(executor)
        for name, fn in zip(names, rewards.build(names, executor=executor, shared=shared)):
            t0 = time.perf_counter()
            fn(prompts=[None] * len(completions), completions=completions, **cols)
            spent[name] += time.perf_counter() - t0
        ran += shared.runs
    return spent, ran


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--batch-questions", type=int, default=8, help="questions per GRPO batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        toy = Path(tmp) / "toy"
        make_toy(toy, seed=args.seed, size="small")
        examples = read_gold(toy / "dev.jsonl")[: args.questions]
        work = list(batches(examples, toy / "databases", args.k, args.batch_questions))
        n = sum(len(c) for c, _ in work)
        names = list(rewards.REGISTRY)
        per_pass, executions = [], []
        with SandboxPool(args.workers, Limits(timeout_s=5.0)) as pool:
            timed_pass(names, work[:1], pool)  # warm-up: workers started, schemas read, golds cached
            for _ in range(args.repeats):
                spent, ran = timed_pass(names, work, pool)
                alone, _ = timed_pass(["cell_precision"], work, pool)
                per_pass.append({**spent, "cell_precision_alone": alone["cell_precision"]})
                executions.append(ran)
    ms = {name: round(statistics.median(p[name] for p in per_pass) / n * 1e3, 4) for name in per_pass[0]}
    fig = {"completions": n, "batches": len(work), "executions_per_pass": executions, "k": args.k,
           "questions": len(examples), "workers": args.workers, "repeats": args.repeats,
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"), "ms_per_completion": ms,
           "ms_per_completion_all": round(sum(v for k, v in ms.items() if k != "cell_precision_alone"), 4)}
    width = max(map(len, ms))
    for name, v in ms.items():
        print(f"{name:<{width}}  {v:8.3f} ms/completion")
    print(f"{'all registered':<{width}}  {fig['ms_per_completion_all']:8.3f} ms/completion "
          f"({n} completions in {len(work)} batches, {executions} executions per pass)", file=sys.stdout)
    print(json.dumps(fig))
    return fig


if __name__ == "__main__":
    main()
