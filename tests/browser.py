"""A real headless browser for the tests: Chromium driven through the DevTools protocol over
a pipe (``--remote-debugging-pipe``, as Puppeteer does), so no driver or websocket package
is needed. :class:`Browser` loads a page and collects what its console reports: uncaught
exceptions, ``console.error`` calls and the browser's own error log entries (a blocked
request, a Content-Security-Policy violation), then evaluates JavaScript in the page and
takes screenshots.

Chromium is Debian's ``chromium`` package (``apt-get install chromium``; ``.ci/run`` installs
it where it can); :func:`chromium_path` is None without it, and :func:`require_chromium` then
skips a test, or fails it under ``CI=true``: CI must not pass without running the browser tests.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

#: why a browser test can't run
MISSING = ("Chromium is not installed (Debian: apt-get install chromium, as root; .ci/run "
           "does it); the report's browser tests need it")


def chromium_path() -> str | None:
    """The Chromium executable on ``PATH``, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def in_ci() -> bool:
    """Whether this is a CI run (``CI=true``, as CI services and ``.ci/run`` set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def skip_without_chromium() -> bool:
    """Whether the browser tests are skipped: no Chromium, outside CI (in CI they fail)."""
    return chromium_path() is None and not in_ci()


def require_chromium(why: str = "") -> str:
    """The Chromium executable; without it the calling test is skipped with the reason, or
    fails under ``CI=true``."""
    found = chromium_path()
    if found is None:
        message = MISSING + (f"; {why}" if why else "")
        if in_ci():
            pytest.fail(f"{message} (CI=true: a browser test fails without it)")
        pytest.skip(message)
    return found


@dataclass
class ConsoleMessage:
    """One thing the page's console reported: ``kind`` is ``exception`` (uncaught),
    ``console.<type>`` or ``log.<level>`` (the browser's own log)."""

    kind: str
    text: str

    @property
    def is_error(self) -> bool:
        return self.kind in ("exception", "console.error", "console.assert", "log.error")


@dataclass
class Browser:
    """One headless Chromium with one page (a context manager). Every call waits at most
    ``timeout_s`` for the browser's answer."""

    executable: str
    timeout_s: float = 30.0
    width: int = 1280
    height: int = 900
    messages: list[ConsoleMessage] = field(default_factory=list)

    def __enter__(self) -> Browser:
        self._profile = tempfile.mkdtemp(prefix="ks-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def pipes_at_3_and_4() -> None:
            # The pipe protocol's file descriptors are 3 (commands) and 4 (answers). Moved
            # above 10 first: a pipe may already be 3 or 4, and dup2 onto itself would leave
            # it close-on-exec.
            reading = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD_CLOEXEC, 10)
            writing = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD_CLOEXEC, 10)
            os.dup2(reading, 3)
            os.dup2(writing, 4)

        self._proc = subprocess.Popen(
            [self.executable, "--headless", "--no-sandbox", "--disable-gpu",
             "--remote-debugging-pipe", f"--user-data-dir={self._profile}",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--hide-scrollbars",
             f"--window-size={self.width},{self.height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=pipes_at_3_and_4, close_fds=False,
            # its own process group: a browser that does not close is ended with its helper
            # processes, and only those
            start_new_session=True)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        target = self._call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self._call("Target.attachToTarget", targetId=target,
                                   flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self._call(f"{domain}.enable", session=True)
        self._call("Emulation.setDeviceMetricsOverride", session=True, width=self.width,
                   height=self.height, deviceScaleFactor=1, mobile=False)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._call("Browser.close")
        except Exception:
            pass
        for fd in (self._to_browser, self._from_browser):
            os.close(fd)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)  # the group this Browser started
            self._proc.wait()
        shutil.rmtree(self._profile, ignore_errors=True)

    # -- the protocol ----------------------------------------------------------------------

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError(f"Chromium ended (exit status {self._proc.poll()})")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def _note(self, event: dict[str, Any]) -> None:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text", "")
            self.messages.append(ConsoleMessage("exception", text))
        elif method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            self.messages.append(ConsoleMessage(f"console.{params['type']}", text))
        elif method == "Log.entryAdded":
            entry = params["entry"]
            self.messages.append(ConsoleMessage(f"log.{entry['level']}", entry["text"]))
        self._events.append(event)

    def _call(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        call_id = self._next_id
        message: dict[str, Any] = {"id": call_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout_s
        while True:
            answer = self._read_message(deadline)
            if answer.get("id") == call_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})
            self._note(answer)

    def _wait_for(self, method: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        for i, event in enumerate(self._events):
            if event.get("method") == method:
                return self._events.pop(i)
        while True:
            event = self._read_message(deadline)
            self._note(event)
            if event.get("method") == method:
                self._events.remove(event)
                return event

    # -- what the tests use ----------------------------------------------------------------

    def open(self, url: str) -> None:
        """Navigate to ``url`` and wait for its load event."""
        self._events.clear()
        self._call("Page.navigate", session=True, url=url)
        self._wait_for("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-able values); an exception
        it throws is raised here."""
        result = self._call("Runtime.evaluate", session=True, expression=expression,
                            returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def click(self, selector: str) -> None:
        """A real mouse click (pressed and released) at the middle of the first element
        matching the CSS ``selector``, scrolled into view first."""
        box = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
            f"e.scrollIntoView({{block: 'center'}}); const r = e.getBoundingClientRect(); "
            f"return [r.x + r.width / 2, r.y + r.height / 2]; }})()")
        for kind in ("mousePressed", "mouseReleased"):
            self._call("Input.dispatchMouseEvent", session=True, type=kind, x=box[0], y=box[1],
                       button="left", clickCount=1)

    def screenshot(self, path: str, full_page: bool = True) -> bytes:
        """A PNG of the page (the whole page with ``full_page``), written to ``path``."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
            size = self._call("Page.getLayoutMetrics", session=True)["cssContentSize"]
            params["clip"] = {"x": 0, "y": 0, "width": size["width"],
                              "height": size["height"], "scale": 1}
        data = base64.b64decode(self._call("Page.captureScreenshot", session=True,
                                           **params)["data"])
        with open(path, "wb") as f:
            f.write(data)
        return data

    def errors(self) -> list[ConsoleMessage]:
        """The error messages seen so far (after draining events already sent)."""
        self.evaluate("0")  # a round trip: events sent before it are collected
        return [m for m in self.messages if m.is_error]
