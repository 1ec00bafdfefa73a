"""Headless Chromium over the DevTools protocol on a pipe, stdlib only: the browser test (tests/test_pipeline.py)
and scripts/screenshots.py drive the MLflow UI with it.

`--remote-debugging-pipe`: commands go in on the child's fd 3 and replies come out on fd 4, each one JSON
message ended by NUL, so neither a port nor a client library is needed. Debian: `apt-get install chromium`.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import watched

# MLflow 3.17's saved-views menu button above the runs table
VIEWS_MENU = "document.querySelector('[data-component-id=\"mlflow.experiment_page.saved_views.trigger\"]')"
# MLflow 3.17 opens its assistant panel (a third of the window) on a local server's first visit; a user closes
# it once and the UI remembers. Its Close button, clicked on each page.
CLOSE_ASSISTANT = "document.querySelector('[data-component-id=\"mlflow.assistant.chat_panel.close\"]')?.click()"


def binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Chromium:
    """One headless Chromium and one page (tab) in it."""

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
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        except BaseException:
            self.close()
            raise

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
        """The value of a JavaScript expression in the page (JSON-serializable values only)."""
        reply = self.page("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression[:80]}: {reply['exceptionDetails'].get('text')}")
        return reply["result"].get("value")

    def wait(self, expression: str, what: str = ""):
        """Poll `expression` until it is truthy (the UI is a JavaScript app that fetches its data after load);
        returns its value, or raises naming `what` and the page's text once SLMSQL_TEST_STALL_S has passed (a
        ceiling for a page that never shows it: a busy machine is slow to render, never a reason to fail). An
        error counts as not yet (a page mid-navigation has no document to read)."""
        timeout_s = watched.STALL_S
        deadline, error = time.monotonic() + timeout_s, None
        while True:
            try:
                if value := self.js(expression):
                    return value
            except RuntimeError as e:
                error = e
            if time.monotonic() > deadline:
                text = self.js("document.body ? document.body.innerText : ''") or ""
                raise TimeoutError(f"{what or expression} not there within {timeout_s:.0f} s (last error: {error}); "
                                   f"the page reads: {' '.join(text.split())[:1500]}")
            time.sleep(0.25)

    def open(self, url: str, size: tuple[int, int], ready: str) -> None:
        """Load `url` at `size` (a new document: an app's page in the same tab starts afresh), wait until the
        page's text contains `ready`, and close the assistant panel."""
        self.page("Emulation.setDeviceMetricsOverride", width=size[0], height=size[1], deviceScaleFactor=1,
                  mobile=False)
        self.page("Page.navigate", url="about:blank")  # a fresh load, even where only the URL's #fragment differs
        self.page("Page.navigate", url=url)
        self.wait(f"document.readyState === 'complete' && document.body.innerText.includes({ready!r})",
                  f"{ready!r} on {url}")
        self.js(CLOSE_ASSISTANT)

    def text(self) -> str:
        return self.js("document.body.innerText")

    def scroll_grid(self, px: int) -> None:
        """Scroll the page's table (ag-grid) `px` to the right, as its scroll bar does."""
        self.js("(() => { const v = document.querySelector('.ag-body-horizontal-scroll-viewport');"
                f" v.scrollLeft = {px}; v.dispatchEvent(new Event('scroll')); }})()")

    def shoot(self, png: Path) -> None:
        png.write_bytes(base64.b64decode(self.page("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        """Ask the browser to quit (it then stops writing its profile), else end it."""
        try:
            self.call("Browser.close")
            self.proc.wait(timeout=20)
        except (OSError, RuntimeError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        os.close(self._in)
        os.close(self._out)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def views_menu_from_home(browser: Chromium, uri: str, experiment_id: str, size: tuple[int, int]) -> None:
    """The docs' first step in MLflow 3.17's UI, as a newcomer clicks it: Home, the sidebar's switch set to
    "Model training" (the browser remembers it), the experiment (it then opens on Training runs), the Views menu
    above the runs table opened."""
    link = f"document.querySelector('a[href=\"#/experiments/{experiment_id}\"]')"
    browser.open(f"{uri}/", size, "Model training")
    browser.js("[...document.querySelectorAll('[role=button]')].find(e => e.innerText === 'Model training').click()")
    browser.wait(f"!!{link}", "the experiment's link on Home")
    browser.js(f"{link}.click()")
    browser.wait(f"location.hash.includes('/runs') && !!{VIEWS_MENU}", "Training runs and its Views menu")
    browser.js(f"{VIEWS_MENU}.dispatchEvent(new PointerEvent('pointerdown', {{bubbles: true, button: 0}}))")
    browser.wait("!!document.querySelector('[role=menu]')", "the Views menu")
