"""scripts/diagnose_study.py, run as users run it, on a sweep folder whose every number is known by hand."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import pandas as pd
import torch
from safetensors.torch import save_file

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "diagnose_study.py"
KEY = "model.layers.0.q_proj"


def _jsonl(path: Path, recs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def _adapter(folder: Path, b0: float):
    """A rank-1 LoRA on one 4x4 weight: scale (alpha / r) 2, B @ A one entry b0, so delta W has one entry 2 b0."""
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 1, "lora_alpha": 2}))
    a, b = torch.zeros(1, 4), torch.zeros(4, 1)
    a[0, 0], b[0, 0] = 1.0, b0
    save_file({f"base_model.model.{KEY}.lora_A.weight": a, f"base_model.model.{KEY}.lora_B.weight": b},
              str(folder / "adapter_model.safetensors"))


@pytest.mark.slow
def test_diagnosis_counts_flips_pass_rates_movement_and_headroom(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    save_file({f"{KEY}.weight": 2 * torch.eye(4), "lm_head.weight": torch.ones(2, 2)}, str(base / "model.safetensors"))
    _adapter(tmp_path / "start", 0.5)  # delta entry 1
    sweep = tmp_path / "sweep"
    q = lambda i, ok, diff="simple": {"id": f"q{i}", "correct": ok, "difficulty": diff}
    _jsonl(sweep / "baseline/band/results.jsonl", [q(0, False), q(1, False), q(2, True), q(3, False, "hard")])
    cell = sweep / "cells/lr_1/seed-7"
    # q0 and q3 turn right, q2 turns wrong, q1 stays wrong
    _jsonl(cell / "eval-band/results.jsonl", [q(0, True), q(1, False), q(2, False), q(3, True, "hard")])
    log = [{"exec/correct": c, "exec/frac_groups_correctness_varies": 0.5, "frac_reward_zero_std": 0.25,
            "completions/clipped_ratio": 0.5 if c < 0.5 else 0.0} for c in [0.1] * 10 + [0.9] * 10]
    (cell / "grpo/checkpoint-20").mkdir(parents=True)
    (cell / "grpo/checkpoint-20/trainer_state.json").write_text(json.dumps({"log_history": log + [{"train_runtime": 1}]}))
    (cell / "grpo/checkpoint-3").mkdir()  # an earlier checkpoint: not the one read
    (cell / "grpo/checkpoint-3/trainer_state.json").write_text(json.dumps({"log_history": []}))
    _adapter(cell / "grpo/adapter", 1.0)  # delta entry 2
    (cell / "grpo/completions").mkdir()  # the run drew q0 and q2 (q3's text differs by a word: not drawn)
    prompt = lambda q: [{"role": "user", "content": f"Database schema:\n...\n\nQuestion: {q}\n\nAnswer with SQL."}]
    pd.DataFrame({"step": [1, 2], "prompt": [prompt("How many a?"), prompt("Which b?")]}).to_parquet(
        cell / "grpo/completions/completions_00001.parquet")
    # step 3 drew q0 again, its prompt once per completion of the group (4 rows, one draw)
    pd.DataFrame({"step": [3] * 4, "prompt": [prompt("How many a?")] * 4}).to_parquet(
        cell / "grpo/completions/completions_00003.parquet")
    _jsonl(tmp_path / "band.jsonl", [{"id": f"q{i}", "question": t} for i, t in
                                     enumerate(["How many a?", "List c.", "Which b?", "How many a and d?"])])
    _jsonl(tmp_path / "passrates.jsonl", [{"id": "q0", "n_correct": 2, "pass_rate": 0.25},
                                          {"id": "q1", "n_correct": 0, "pass_rate": 0.0}])
    out = subprocess.run([sys.executable, str(SCRIPT), "--sweep", str(sweep), "--passrates", str(tmp_path / "passrates.jsonl"),
                          "--start-adapter", str(tmp_path / "start"), "--base", str(base),
                          "--rl-data", str(tmp_path / "band.jsonl")],
                         capture_output=True, text=True, check=True).stdout
    d = json.loads(out.splitlines()[-1])
    (c,) = d["cells"]
    assert (c["variant"], c["seed"], c["pass_first10"], c["pass_last10"]) == ("lr_1", 7, 0.1, 0.9)
    assert (c["groups_vary"], c["zero_std"]) == (0.5, 0.25)
    assert (c["cut_first10"], c["cut_last10"]) == (0.5, 0.0)
    assert (c["draws_min"], c["draws_max"]) == (0, 2)  # q0 at steps 1 and 3, q2 at step 2, q1 and q3 never
    # ||W|| = 2 * sqrt(4) = 4; GRPO moved the entry from 1 to 2 (0.25 of ||W||); the start moved it 1 from 0 (0.25)
    assert abs(c["lora_movement"] - 0.25) < 1e-6 and abs(d["start_lora_movement"] - 0.25) < 1e-6
    assert c["flips"]["band"] == {"turned_right": 2, "turned_wrong": 1, "by_difficulty": {"hard": [1, 0], "simple": [1, 1]}}
    # drawn: q0 turned right, q2 turned wrong; not drawn: q1 (unchanged), q3 turned right
    assert c["flips"]["band (drawn)"] == {"n": 2, "turned_right": 1, "turned_wrong": 1,
                                          "by_difficulty": {"simple": [1, 1]}}
    assert c["flips"]["band (not drawn)"] == {"n": 2, "turned_right": 1, "turned_wrong": 0,
                                              "by_difficulty": {"hard": [1, 0]}}
    # the start gets q0, q1, q3 wrong; the filter sampled q0 (2 of 8 right) and q1 (none)
    assert d["headroom"]["band"] == {"greedy_wrong": 2, "any_sample_right": 1, "mean_pass_rate": 0.125}
    assert "| lr_1 seed 7 | 0.10 -> 0.90 | 50% | 25% | 0.2500 | 50% -> 0% | 0-2 |" in out


def test_diagnosis_refuses_a_folder_that_is_not_a_sweep(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--sweep", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode != 0 and "not a sweep's output folder" in r.stderr and not r.stdout
