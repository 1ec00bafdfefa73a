"""Why a sweep's GRPO gained or did not: the diagnosis docs/studies.md reports for each study.

    python scripts/diagnose_study.py --sweep outputs/smollm2-study/sweep \
        --passrates outputs/smollm2-study/filter/passrates.jsonl --start-adapter outputs/smollm2-study/sft \
        --base HuggingFaceTB/SmolLM2-135M-Instruct

From the files a sweep leaves (`<sweep>/baseline/<set>/results.jsonl`, `<sweep>/cells/<variant>/seed-<n>/`), for
every cell:
  - the optimizer: the sampled training pass rate (`exec/correct`), mean of the first vs the last 10 logged steps;
    the share of groups whose correctness varies and of groups with zero reward variance (reward separation);
    the LoRA's movement, ||delta(scale * B @ A)|| / ||W|| over the adapted weights (from the start's adapter when
    GRPO continued one, else from zero), W read from the base's safetensors (a folder, or a Hub id in the cache);
  - the questions that changed, per eval set: how many the start got wrong and the cell right ("turned right") and
    the reverse, by difficulty; with --rl-data, on an eval set drawn from it (the band), split into the questions
    the run drew for training (their text in its logged completions, `grpo/completions/*.parquet`) and the rest;
  - how often it drew each RL question (min-max over the RL data: a study that trains N passes says N-N) and the
    share of its training completions cut at the token budget (TRL's `completions/clipped_ratio`, first vs last 10
    steps: a reward that favours longer SQL shows here first);
and once: the headroom GRPO can reach (with --passrates, the filter's K samples of the start): of the questions
the start gets wrong greedily on each eval set that the filter sampled, how many any sample got right.
Prints markdown tables; the last line is JSON. The training-log figures, the draws and the turned counts are
`slmsql.studies.diagnosis`'s: a study's cell records keep the same figures, and its report the same counts.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path
from statistics import mean

from slmsql.studies import diagnosis


def rows(path: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines()) if r}


def lora_delta(adapter: Path) -> dict:
    """scale * B @ A for every adapted weight, keyed by the base weight's name."""
    from safetensors.torch import load_file
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / (math.sqrt(cfg["r"]) if cfg.get("use_rslora") else cfg["r"])
    t = load_file(str(adapter / "adapter_model.safetensors"))
    out = {}
    for key, a in t.items():
        if ".lora_A." in key:
            name = re.sub(r"^base_model\.model\.", "", key.replace(".lora_A.", ".")).replace(".weight", "") + ".weight"
            out[name] = scale * (t[key.replace(".lora_A.", ".lora_B.")].float() @ a.float())
    return out


def base_weights(base: str, names) -> dict:
    """The named weights of a base model's safetensors (a local folder, or a Hub id already in the cache)."""
    from safetensors import safe_open
    folder = Path(base)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download
        folder = Path(snapshot_download(base, local_files_only=True))
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if k in names:
                    out[k] = st.get_tensor(k).float()
    missing = set(names) - set(out)
    if missing:
        raise SystemExit(f"{base}: no weight named {sorted(missing)[0]} (of {len(missing)} adapted weights)")
    return out


def movement(adapter: Path, start: Path | None, base: str) -> float:
    d = lora_delta(adapter)
    s = lora_delta(start) if start else {}
    w = base_weights(base, set(d))
    num = sum(float(((d[k] - s[k]) if k in s else d[k]).pow(2).sum()) for k in d)
    return math.sqrt(num / sum(float(w[k].pow(2).sum()) for k in d))


def flips(start: dict, cell: dict, only: set | None = None) -> dict:
    by = defaultdict(dict)  # difficulty -> {question id: correct}
    for qid, r in cell.items():
        if only is None or qid in only:
            by[r.get("difficulty", "all")][qid] = r["correct"]
    split = {k: diagnosis.turned({q: start[q]["correct"] for q in v}, v) for k, v in sorted(by.items())}
    return {"turned_right": sum(r for r, _ in split.values()), "turned_wrong": sum(w for _, w in split.values()),
            "by_difficulty": {k: v for k, v in split.items() if v != (0, 0)}}


def diagnose(sweep: Path, passrates: Path | None, start_adapter: Path | None, base: str | None,
             rl_data: Path | None = None) -> dict:
    starts = {d.name: rows(d / "results.jsonl") for d in sorted((sweep / "baseline").iterdir())
              if (d / "results.jsonl").is_file()}
    cells = []
    rl = rows(rl_data) if rl_data else {}
    for seed_dir in sorted((sweep / "cells").glob("*/seed-*")):
        times = diagnosis.draws(seed_dir / "grpo", rl) if rl else Counter()
        figures = {**diagnosis.training(diagnosis.log_history(seed_dir / "grpo")), **diagnosis.draw_range(times, rl)}
        c = {"variant": seed_dir.parent.name, "seed": int(seed_dir.name.split("-")[1]),
             **{k: v for k, v in figures.items() if v is not None}}  # a figure its files lack: n/a in the table
        if base and (seed_dir / "grpo" / "adapter" / "adapter_config.json").is_file():
            c["lora_movement"] = movement(seed_dir / "grpo" / "adapter", start_adapter, base)
        c["flips"] = {}
        trained = set(times)
        for ev in sorted(seed_dir.glob("eval-*/results.jsonl")):
            name = ev.parent.name[len("eval-"):]
            if name in starts:
                res = rows(ev)
                c["flips"][name] = flips(starts[name], res)
                if rl and set(res) <= set(rl):  # an eval set drawn from the RL data: drawn vs not
                    c["flips"][name + " (drawn)"] = {"n": len(trained & set(res)), **flips(starts[name], res, trained)}
                    rest = set(res) - trained
                    c["flips"][name + " (not drawn)"] = {"n": len(rest), **flips(starts[name], res, rest)}
        cells.append(c)
    out = {"cells": cells}
    if base and start_adapter:  # the yardstick: how far the start's own adapter moved W
        out["start_lora_movement"] = movement(start_adapter, None, base)
    if passrates:
        pr = rows(passrates)
        out["headroom"] = {}
        for name, st in starts.items():
            wrong = [pr[q] for q, r in st.items() if not r["correct"] and q in pr]
            if wrong:
                out["headroom"][name] = {"greedy_wrong": len(wrong),
                                         "any_sample_right": sum(p["n_correct"] > 0 for p in wrong),
                                         "mean_pass_rate": mean(p["pass_rate"] for p in wrong)}
    return out


def markdown(d: dict) -> str:
    lines = ["| cell | train pass rate, first -> last 10 steps | groups varying | zero reward std | LoRA movement "
             "| cut at the token budget, first -> last 10 | draws per RL question (min-max) |",
             "|---|---|---:|---:|---:|---|---|"]
    for c in d["cells"]:
        mv = f"{c['lora_movement']:.4f}" if "lora_movement" in c else "n/a"
        tr = f"{c['pass_first10']:.2f} -> {c['pass_last10']:.2f}" if "pass_first10" in c else "n/a"
        gv = f"{c['groups_vary']:.0%}" if "groups_vary" in c else "n/a"
        zs = f"{c['zero_std']:.0%}" if "zero_std" in c else "n/a"
        cut = f"{c['cut_first10']:.0%} -> {c['cut_last10']:.0%}" if "cut_first10" in c else "n/a"
        dr = f"{c['draws_min']}-{c['draws_max']}" if "draws_min" in c else "n/a"
        lines.append(f"| {c['variant']} seed {c['seed']} | {tr} | {gv} | {zs} | {mv} | {cut} | {dr} |")
    lines += ["", "| cell | eval set | turned right | turned wrong | by difficulty (right, wrong) |", "|---|---|---:|---:|---|"]
    for c in d["cells"]:
        for name, f in c["flips"].items():
            by = ", ".join(f"{k} {r}/{w}" for k, (r, w) in f["by_difficulty"].items())
            n = f" (n {f['n']})" if "n" in f else ""
            lines.append(f"| {c['variant']} seed {c['seed']} | {name}{n} | {f['turned_right']} | {f['turned_wrong']} | {by} |")
    if "start_lora_movement" in d:
        lines.append(f"\nthe start's own adapter: LoRA movement {d['start_lora_movement']:.4f}")
    for name, h in d.get("headroom", {}).items():
        lines.append(f"\nheadroom on {name}: {h['any_sample_right']} of the {h['greedy_wrong']} questions the start gets "
                     f"wrong greedily have a right sample among the filter's (mean pass rate {h['mean_pass_rate']:.2f})")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", required=True, type=Path, help="a sweep's --output-dir")
    ap.add_argument("--passrates", type=Path, help="the filter's passrates.jsonl for the start (headroom)")
    ap.add_argument("--start-adapter", type=Path, help="the adapter GRPO continued (its movement is subtracted)")
    ap.add_argument("--base", help="the base model (folder or cached Hub id): with it, the LoRA's movement")
    ap.add_argument("--rl-data", type=Path, help="the RL data the cells trained on (the band): flips split drawn / not")
    a = ap.parse_args(argv)
    if not (a.sweep / "cells").is_dir():
        raise SystemExit(f"{a.sweep}: not a sweep's output folder (no cells/)")
    d = diagnose(a.sweep, a.passrates, a.start_adapter, a.base, a.rl_data)
    print(markdown(d))
    print(json.dumps(d))


if __name__ == "__main__":
    main()
