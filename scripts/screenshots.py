"""Regenerate the docs' "Looking at the results" images (docs/getting-started.md) from a demo run's tracking server store.

    slmsql server &                                           # mlflow-server.db, artifacts served from mlartifacts/
    MLFLOW_TRACKING_URI=http://127.0.0.1:5000 slmsql pipeline   # the demo, tracked through the server
    python scripts/screenshots.py --store mlflow-server.db --artifacts mlartifacts --out docs/img

A store written through a server records artifacts as `mlflow-artifacts:/` URIs, so no page shows a folder of
the machine that ran it. Starts a real `mlflow server` on loopback on a copy of the store and its artifacts (the
demo's own are not touched), drives headless Chromium (`apt-get install chromium` on Debian) over the DevTools
protocol and saves:
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
import base64
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# MLflow 3.17 opens its assistant panel on a local server's first visit (a third of the window); a user closes
# it once and the UI remembers. The script clicks the same Close button on each page.
CLOSE_ASSISTANT = "document.querySelector('[data-component-id=\"mlflow.assistant.chat_panel.close\"]')?.click()"


class Chromium:
    """Headless Chromium over the DevTools protocol on a pipe (`--remote-debugging-pipe`: commands in on fd 3,
    replies out on fd 4, each one JSON message ended by NUL), so no client library is needed."""

    def __init__(self, binary: str, profile: Path):
        to_child, self._in = os.pipe()
        self._out, from_child = os.pipe()

        def onto_3_and_4():  # in the child: move the pipe ends out of the way, then onto fds 3 and 4
            a, b = fcntl.fcntl(to_child, fcntl.F_DUPFD, 10), fcntl.fcntl(from_child, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)  # dup2 leaves 3 and 4 inheritable; every other fd of ours closes on exec

        self.proc = subprocess.Popen([binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                      "--remote-debugging-pipe", f"--user-data-dir={profile}", "about:blank"],
                                     preexec_fn=onto_3_and_4, close_fds=False, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self._n, self._buf = 0, b""
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def call(self, method: str, session: str | None = None, **params) -> dict:
        self._n += 1
        msg = {"id": self._n, "method": method, "params": params} | ({"sessionId": session} if session else {})
        os.write(self._in, json.dumps(msg).encode() + b"\0")
        while True:  # events (messages without our id) are skipped
            while b"\0" not in self._buf:
                chunk = os.read(self._out, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium exited during {method}")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._n:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def page(self, method: str, **params) -> dict:
        return self.call(method, self.session, **params)

    def js(self, expression: str):
        return self.page("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def open(self, url: str, size: tuple[int, int], ready: str, timeout_s: float = 60) -> None:
        """Load `url` at `size` and wait until the page's text contains `ready` (the UI is a JavaScript app that
        fetches its data after load), then a moment for the layout to settle."""
        self.page("Emulation.setDeviceMetricsOverride", width=size[0], height=size[1], deviceScaleFactor=1,
                  mobile=False)
        self.page("Page.navigate", url=url)
        deadline = time.time() + timeout_s
        while not self.js(f"document.readyState === 'complete' && document.body.innerText.includes({ready!r})"):
            if time.time() > deadline:
                raise RuntimeError(f"{url}: {ready!r} did not appear within {timeout_s:.0f} s")
            time.sleep(0.5)
        self.js(CLOSE_ASSISTANT)
        time.sleep(2)

    def scroll_grid(self, px: int) -> None:
        """Scroll the page's table (ag-grid) `px` to the right, as its scroll bar does."""
        self.js("(() => { const v = document.querySelector('.ag-body-horizontal-scroll-viewport');"
                f" v.scrollLeft = {px}; v.dispatchEvent(new Event('scroll')); }})()")
        time.sleep(1)

    def shoot(self, png: Path) -> None:
        png.write_bytes(base64.b64decode(self.page("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        os.close(self._in)
        os.close(self._out)


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
    ap.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    args = ap.parse_args()

    import mlflow

    from slmsql import tracking

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
                # datasets and each eval set's EX beside the (pinned) model names
                "models-tab": (f"{base}/models?{mode}", (1600, 700), "Source run", 0.5, 600),
                "pipeline-run": (f"{base}/runs/{parent.info.run_id}?{mode}", (1600, 1100), "GRPO vs SFT", 0.85, 0),
                "eval-run": (f"{base}/runs/{paired}/artifacts/disagreements_table.json?{mode}", (1600, 800),
                             "gold_sql", 0.75, 0),
            }
            sizes = {}
            for name, (url, size, ready, bottom, scroll) in pages.items():
                raw = tmp / f"{name}.raw.png"
                browser.open(url, size, ready)
                if scroll:
                    browser.scroll_grid(scroll)
                browser.shoot(raw)
                sizes[name] = shrink(raw, out / f"{name}.png", (0.0, 0.0, 1.0, bottom), 1200)
        finally:
            browser.close()
            proc.terminate()
            proc.wait(timeout=60)
    print(json.dumps({"images": {k: f"{out / k}.png" for k in sizes}, "bytes": sizes}))


if __name__ == "__main__":
    sys.exit(main())
