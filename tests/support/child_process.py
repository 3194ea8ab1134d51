"""Our processes as real children in tests and benchmarks: started from the repository (its
root on PYTHONPATH and as the working directory) with output to a log file, waited on until a
readiness probe passes (failing at once, with the log, if the child exits), stopped by a signal
with kill -9 after a timeout; and the JSON GET their health endpoints answer."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def spawn(args: Sequence[str], log_path: Path, *, append: bool = True) -> subprocess.Popen[bytes]:
    """Start ``args`` in the repository root, stdout and stderr to ``log_path``."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(log_path, "ab" if append else "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(list(args), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def wait_ready(proc: subprocess.Popen[bytes], is_ready: Callable[[], bool], *, name: str, timeout_s: float,
               output: Callable[[], str], poll_s: float = 0.05) -> None:
    """Poll ``is_ready`` (OSError and ValueError count as not yet) until it holds; RuntimeError
    with ``output()`` when the child exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{output()}")
        try:
            if is_ready():
                return
        except (OSError, ValueError):
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{name} not ready within {timeout_s}s:\n{output()}")


def get_json(url: str, timeout_s: float = 2.0) -> tuple[int, Any]:
    """``(status, body)`` of a GET whose answer is JSON, error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def log_tail(path: Path, n: int = 40) -> str:
    """The last ``n`` lines of a log ("" when there is none yet)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def stop_process(proc: subprocess.Popen[bytes] | None, sig: int, timeout_s: float) -> int:
    """Send ``sig``, wait up to ``timeout_s``, then kill -9; the exit code (0 if not running)."""
    if proc is None:
        return 0
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
