"""Headless Chromium driven through the DevTools protocol over ``--remote-debugging-pipe``.

Chromium reads commands from fd 3 and writes replies and events to fd 4, each one JSON message
ended by a NUL byte: no WebSocket client, no WebDriver. Enough of the protocol to open a page,
evaluate JavaScript in it, wait for a condition and press keys the way a user does (the browser
itself moves a focused slider and fires its events).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.web.browser import chromium_or_skip

KEYS = {"ArrowRight": 39, "ArrowLeft": 37, "Home": 36, "End": 35}


class DevToolsError(Exception):
    pass


class Page:
    """One Chromium process with one page; use as a context manager."""

    def __init__(self, workdir: Path, width: int = 1400, height: int = 900) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        # Our ends of the two pipes on high fds, so that putting the child's ends on 3 and 4
        # cannot overwrite one another.
        to_child, from_child = os.pipe(), os.pipe()
        fds = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 20) for fd in (*to_child, *from_child)]
        for fd in (*to_child, *from_child):
            os.close(fd)
        child_in, self._out, self._in, child_out = fds

        def place_fds() -> None:  # runs in the child before exec
            os.dup2(child_in, 3)
            os.dup2(child_out, 4)

        cmd = [chromium_or_skip(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               "--disable-extensions", "--remote-debugging-pipe", f"--window-size={width},{height}",
               f"--user-data-dir={workdir / 'profile'}", "about:blank"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=place_fds, pass_fds=(3, 4))
        os.close(child_in)
        os.close(child_out)
        self._buf = b""
        self._next_id = 0
        self.errors: list[str] = []  # uncaught exceptions in the page's scripts
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"]
        self.send("Runtime.enable", session=True)

    def __enter__(self) -> Page:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(DevToolsError, OSError):
            self.send("Browser.close", timeout_s=5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._out, self._in):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- the protocol -----------------------------------------------------------------------

    def send(self, method: str, params: dict[str, Any] | None = None, session: bool = False,
             timeout_s: float = 30.0) -> dict[str, Any]:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._read(deadline)
            if reply.get("method") == "Runtime.exceptionThrown":
                details = reply["params"]["exceptionDetails"]
                self.errors.append(details.get("exception", {}).get("description")
                                   or details.get("text", "?"))
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise DevToolsError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise DevToolsError("no reply from chromium in time")
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                raise DevToolsError(f"chromium closed the pipe (exit {self.proc.poll()})")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message

    # -- what tests do ----------------------------------------------------------------------

    def goto(self, url: str) -> None:
        self.send("Page.navigate", {"url": url}, session=True)

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        res = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                             "awaitPromise": True}, session=True)
        if "exceptionDetails" in res:
            raise DevToolsError(f"{expression}: {res['exceptionDetails'].get('text')}: "
                                f"{res['exceptionDetails'].get('exception', {}).get('description')}")
        return res["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 15.0) -> Any:
        """Poll until the expression is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = self.eval(expression)
            except DevToolsError:
                value = None  # e.g. the page is still loading
            if value:
                return value
            if time.monotonic() > deadline:
                raise DevToolsError(f"timed out waiting for {expression}")
            time.sleep(0.05)

    def press(self, key: str) -> None:
        """A key press as the user makes it, on the focused element."""
        code = KEYS[key]
        for kind in ("rawKeyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent", {"type": kind, "key": key, "code": key,
                                                 "windowsVirtualKeyCode": code}, session=True)

    def screenshot(self, path: Path, width: int, height: int) -> None:
        """A PNG of the page in a ``width`` x ``height`` viewport."""
        self.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                         "deviceScaleFactor": 1, "mobile": False},
                  session=True)
        data = self.send("Page.captureScreenshot", {"format": "png"}, session=True)["data"]
        path.write_bytes(base64.b64decode(data))

    def text(self, element_id: str) -> str:
        value: str = self.eval(f"document.getElementById({json.dumps(element_id)}).textContent")
        return value
