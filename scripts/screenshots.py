"""Regenerate the README's "Looking at the results" images from a demo run's tracking store.

    make demo                                  # or: slmsql pipeline (writes ./mlflow.db and ./mlruns)
    python scripts/screenshots.py --store mlflow.db --out docs/img

Starts a real `mlflow server` on loopback on a copy of the store (the demo's own store is not touched),
opens the MLflow UI in headless Chromium (`apt-get install chromium` on Debian) and saves:
  runs-table.png     the experiment's runs table as `ui_link` opens it (grouped by eval set, slmsql's columns)
  pipeline-run.png   the pipeline run's overview: its description (the headline), metrics and verdict tags
  eval-run.png       the paired GRPO evaluation on dev: its table of the questions only one side got right
The UI is a JavaScript app: Chromium is given a virtual-time budget to render it. Each image is cropped to
the page (the UI's assistant panel on the right is left out), scaled down and palette-quantized to stay small.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

NAV, PAGE = 0.11, 0.735  # at 1800 px wide: the UI's left menu ends, its assistant panel begins


def shoot(chromium: str, url: str, png: Path, size: tuple[int, int], budget_ms: int = 25000) -> None:
    cmd = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--force-device-scale-factor=1", f"--window-size={size[0]},{size[1]}",
           f"--virtual-time-budget={budget_ms}", f"--screenshot={png}", url]
    subprocess.run(cmd, check=True, capture_output=True, timeout=180)


def shrink(src: Path, dst: Path, box: tuple[float, float, float, float], width: int, colors: int = 96) -> int:
    """Crop `box` (fractions of the image), scale to `width`, quantize; returns the file size."""
    from PIL import Image

    img = Image.open(src).convert("RGB")
    w, h = img.size
    img = img.crop((int(box[0] * w), int(box[1] * h), int(box[2] * w), int(box[3] * h)))
    img = img.resize((width, round(img.height * width / img.width)), Image.LANCZOS)
    img.quantize(colors=colors, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(dst, optimize=True)
    return dst.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", default="mlflow.db", help="SQLite tracking store of a demo run")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "img"))
    ap.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    args = ap.parse_args()

    import mlflow

    from slmsql import tracking

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shutil.copy(args.store, tmp / "store.db")
        proc, uri = tracking.start_server(port=0, store=tmp / "store.db", artifacts=tmp / "artifacts",
                                          timeout_s=300)
        try:
            client = mlflow.MlflowClient(uri)
            exp = client.get_experiment_by_name("slmsql")
            runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
            parent = next(r for r in runs if r.data.tags.get("slmsql.stage") == "pipeline")
            children = {r.info.run_name: r for r in runs
                        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
            # this copy of the store shows the current view, whatever view the demo run saved
            tracking.pin_view(exp.experiment_id, parent.info.run_id, client)
            base = f"{uri}/#/experiments/{exp.experiment_id}"
            mode = "workflowType=machine_learning"
            paired = children["eval-grpo-dev"].info.run_id
            pages = {  # name: (url, window size, crop box as fractions, width of the saved image)
                # a laptop's 1600 px: the grouped table, each pair's verdict in one row, no horizontal scroll
                "runs-table": (tracking.ui_link(exp.experiment_id, uri), (1600, 900), (0.0, 0.0, 1.0, 0.96), 1200),
                # MLflow 3's Models tab: each policy's LoggedModel with its EX per eval set
                "models-tab": (f"{base}/models?{mode}", (1600, 700), (0.0, 0.0, 1.0, 1.0), 1200),
                "pipeline-run": (f"{base}/runs/{parent.info.run_id}?{mode}", (1800, 1100), (NAV, 0.0, PAGE, 0.8), 900),
                "eval-run": (f"{base}/runs/{paired}/artifacts/disagreements_table.json?{mode}", (1800, 800),
                             (NAV, 0.0, PAGE, 0.72), 900),
            }
            sizes = {}
            for name, (url, size, box, width) in pages.items():
                raw = tmp / f"{name}.raw.png"
                shoot(args.chromium, url, raw, size)
                sizes[name] = shrink(raw, out / f"{name}.png", box, width)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(json.dumps({"images": {k: f"{out / k}.png" for k in sizes}, "bytes": sizes}))


if __name__ == "__main__":
    sys.exit(main())
