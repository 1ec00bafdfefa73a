"""The toy SFT on several CPU float paths: does it reach its purpose (a usable band) on each?

CPU floats differ between machines: MKL and oneDNN pick their GEMM kernels by instruction set and vendor, ATen its
own by `ATEN_CPU_CAPABILITY`. A recipe tuned on one machine can sit on a knife edge on another (issue 55: the
pipeline test's 400-step SFT reached 36% EX on an AVX-512 Intel machine and 2.5% on an AVX2-only AMD one, and the
filter then found a band of 1 question in 300). This runs the same toy SFT -> evaluate (dev) -> filter
(rl_source) chain once per path, each in new processes with the path's environment:

    default   whatever this machine picks
    avx2      MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 (an AVX2-only machine,
              the GEMMs included)
    cbwr      MKL_CBWR=COMPATIBLE (MKL's most portable path)

and prints, per path, SFT's mean training loss, EX on toy dev and the filter's buckets. On an AVX2-only machine the
`avx2` path is the `default` one. Figures are about the toy world only.

    PYTHONPATH=src OMP_NUM_THREADS=1 python bench/float_paths.py       # the demo's SFT (and the pipeline test's)
    PYTHONPATH=src OMP_NUM_THREADS=1 python bench/float_paths.py --sft-args "--max-steps 400" --paths default
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PATHS = {
    "default": {},
    "avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "cbwr": {"MKL_CBWR": "COMPATIBLE"},
}
FLOAT_VARS = sorted({k for env in PATHS.values() for k in env})


def slmsql(root: Path, env: dict, *args: str) -> float:
    """One stage in a new process; its log under root/logs; returns its wall seconds."""
    log = root / "logs" / f"{args[0]}-{int(time.time() * 1000)}.log"
    log.parent.mkdir(exist_ok=True)
    t0 = time.time()
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-m", "slmsql.cli", *args], cwd=root, env=env, stdout=f,
                              stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"slmsql {' '.join(args)} failed (exit {done.returncode}): see {log}")
    return time.time() - t0


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def one_path(root: Path, name: str, base_env: dict, sft_args: list[str], filter_args: list[str] | None,
             eval_args: list[str] = ()) -> dict:
    env = {k: v for k, v in base_env.items() if k not in FLOAT_VARS} | PATHS[name]
    toy, out = root / "toy", root / name
    dbs = ["--db-root", str(toy / "databases")]
    # the untrained model too: its random init may take the path's vectorised kernels, as on such a machine
    t = {"tiny-model": slmsql(root, env, "tiny-model", "--data", str(toy), "--output-dir", str(out / "tiny"))}
    t["sft"] = slmsql(root, env, "sft", "--model", str(out / "tiny"), "--data", str(toy / "sft.jsonl"), *dbs,
                       "--output-dir", str(out / "sft"), *sft_args)
    t["evaluate"] = slmsql(root, env, "evaluate", "--model", str(out / "sft"), "--data", str(toy / "dev.jsonl"), *dbs,
                           "--output-dir", str(out / "eval"), *eval_args)
    fl = {}
    if filter_args is not None:  # None: EX only, a quick screen of a recipe
        t["filter"] = slmsql(root, env, "filter", "--model", str(out / "sft"), "--data", str(toy / "rl_source.jsonl"),
                             *dbs, "--output-dir", str(out / "filter"), *filter_args)
        fl = read_json(out / "filter" / "summary.json")
        fl = {"n_source": fl["n_source"], **fl["buckets"]}
    sft, ev = read_json(out / "sft" / "sft_summary.json"), read_json(out / "eval" / "metrics.json")
    return {"path": name, "sft_mean_train_loss": round(sft["train_loss"], 4), "sft_steps": sft["steps"],
            "ex_dev": ev["ex"], "ex_dev_ci": [ev["ex_ci_low"], ev["ex_ci_high"]], "n_dev": ev.get("n"),
            **{k: fl.get(k) for k in ("n_source", "band", "all_fail", "all_pass", "out_of_band")},
            "seconds": {k: round(v, 1) for k, v in t.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paths", default="default,avx2,cbwr", help="comma-separated: " + ", ".join(PATHS))
    ap.add_argument("--sft-args", default="", help="extra `slmsql sft` options (default: none, the demo's and the "
                    "pipeline test's SFT); '--max-steps 400' is the one issue 55 found on a knife edge")
    ap.add_argument("--filter-args", default="", help="extra `slmsql filter` options, e.g. '--limit 60'")
    ap.add_argument("--eval-args", default="", help="extra `slmsql evaluate` options, e.g. '--limit 20'")
    ap.add_argument("--no-filter", action="store_true", help="EX on dev only, no filter (a quick screen)")
    ap.add_argument("--toy-args", default="", help="extra `slmsql toy` options")
    ap.add_argument("--root", default="", help="work folder (default: a temporary one)")
    a = ap.parse_args()
    paths = [p for p in a.paths.split(",") if p]
    if unknown := [p for p in paths if p not in PATHS]:
        sys.exit(f"--paths: unknown {unknown}; known: {', '.join(PATHS)}")
    root = Path(a.root or tempfile.mkdtemp(prefix="float-paths-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db", "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_RUN_ID", None)
    # the world is the same bytes on every path (`slmsql toy` is deterministic from its seed, no float kernels)
    slmsql(root, env, "toy", "--output-dir", str(root / "toy"), *shlex.split(a.toy_args))
    rows = []
    for name in paths:
        row = one_path(root, name, env, shlex.split(a.sft_args),
                       None if a.no_filter else shlex.split(a.filter_args), shlex.split(a.eval_args))
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(json.dumps({"sft_args": a.sft_args, "eval_args": a.eval_args,
                      "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                      "paths": {r["path"]: {"ex_dev": r["ex_dev"], "band": r.get("band"), "n_source": r.get("n_source")}
                                for r in rows}}))


if __name__ == "__main__":
    main()
