"""Regenerate the docs' "Looking at the results" images (docs/getting-started.md) from a demo run's tracking server store.

    slmsql server &                                           # mlflow-server.db, artifacts served from mlartifacts/
    MLFLOW_TRACKING_URI=http://127.0.0.1:5000 slmsql pipeline   # the demo, tracked through the server
    python scripts/screenshots.py --store mlflow-server.db --artifacts mlartifacts --out docs/img

A store written through a server records artifacts as `mlflow-artifacts:/` URIs, so no page shows a folder of
the machine that ran it. Starts a real `mlflow server` on loopback on a copy of the store and its artifacts (the
demo's own are not touched), drives headless Chromium (`apt-get install chromium` on Debian) over the DevTools
protocol and saves:
  views-menu.png     from Home (the sidebar switch set to Model training): the experiment's Training runs, its
                     Views menu open on slmsql's view
  runs-table.png     the experiment's runs table as `ui_link` opens it (grouped by eval set, slmsql's columns)
  models-tab.png     MLflow 3's Models tab: each policy's LoggedModel with its EX per eval set
  pipeline-run.png   the pipeline run's overview: its description (the headline), metrics and verdict tags
  eval-run.png       the paired GRPO evaluation on dev: its table of the questions only one side got right
The pages are shot as a returning user sees them: MLflow 3.17 opens its assistant panel (a third of the window)
on a local server's first visit and remembers when it is closed; the script clicks its Close button. Each image
is scaled down and palette-quantized to stay small.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
# the DevTools client the browser test uses too
from devtools import Chromium, binary, views_menu_from_home  # noqa: E402

SETTLE_S = 2  # after the data is in, for the layout to settle before a picture (a picture only: no test waits)


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
    ap.add_argument("--store", default="mlflow-server.db", help="SQLite store of a demo run tracked through a server")
    ap.add_argument("--artifacts", default="mlartifacts", help="that server's artifacts folder")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "img"))
    ap.add_argument("--chromium", default=binary() or "chromium")
    args = ap.parse_args()

    import mlflow

    from slmsql.tracking import runs as tracking

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shutil.copy(args.store, tmp / "store.db")
        shutil.copytree(args.artifacts, tmp / "artifacts")
        proc, uri = tracking.start_server(port=0, store=tmp / "store.db", artifacts=tmp / "artifacts",
                                          timeout_s=300)
        browser = Chromium(args.chromium, tmp / "profile")
        try:
            client = mlflow.MlflowClient(uri)
            exp = client.get_experiment_by_name("slmsql")
            runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
            parent = next(r for r in runs if r.data.tags.get("slmsql.stage") == "pipeline")
            children = {r.info.run_name: r for r in runs
                        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
            tracking.save_view(exp.experiment_id, client)  # the current view, whatever view the demo run saved
            base = f"{uri}/#/experiments/{exp.experiment_id}"
            mode = "workflowType=machine_learning"
            paired = children["eval-grpo-dev"].info.run_id
            pages = {  # name: (url, window size, text that says the data is in, bottom crop, grid scroll px)
                # a laptop's 1600 px: the grouped table, each pair's verdict in one row, no horizontal scroll
                "runs-table": (tracking.ui_link(exp.experiment_id, uri), (1600, 900), "eval-grpo-dev_cross", 0.75, 0),
                # scrolled past three 200 px model attributes (logged from, source run, registered models): the
                # datasets and each eval set's EX beside the (pinned) model names. Ready when the metric column
                # groups are in ("Dataset: toy-dev_cross"): the attributes come first, and a grid scrolled before
                # its metric columns arrive is not wide enough to scroll
                "models-tab": (f"{base}/models?{mode}", (1600, 700), "toy-dev_cross", 0.5, 600),
                "pipeline-run": (f"{base}/runs/{parent.info.run_id}?{mode}", (1600, 1100), "GRPO vs SFT", 0.85, 0),
                "eval-run": (f"{base}/runs/{paired}/artifacts/disagreements_table.json?{mode}", (1600, 800),
                             "gold_sql", 0.75, 0),
            }
            sizes = {}
            views_menu_from_home(browser, uri, exp.experiment_id, (1600, 900))
            time.sleep(SETTLE_S)
            browser.shoot(tmp / "views-menu.raw.png")
            sizes["views-menu"] = shrink(tmp / "views-menu.raw.png", out / "views-menu.png", (0.0, 0.0, 1.0, 0.5), 1200)
            for name, (url, size, ready, bottom, scroll) in pages.items():
                raw = tmp / f"{name}.raw.png"
                browser.open(url, size, ready)
                if scroll:
                    browser.scroll_grid(scroll)
                time.sleep(SETTLE_S)
                browser.shoot(raw)
                sizes[name] = shrink(raw, out / f"{name}.png", (0.0, 0.0, 1.0, bottom), 1200)
        finally:
            browser.close()
            proc.terminate()
            proc.wait(timeout=60)
    print(json.dumps({"images": {k: f"{out / k}.png" for k in sizes}, "bytes": sizes}))


if __name__ == "__main__":
    sys.exit(main())
