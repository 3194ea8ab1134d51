"""An engine started without --engine-id names itself HOSTNAME-PID: two such engines never share
an identity at offloadd or in the log, and each shows its id in its startup log and metrics."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from engine.config import EngineConfig, default_engine_id


def test_defaults_in_one_process_differ() -> None:
    a, b = EngineConfig(model_dir="m"), EngineConfig(model_dir="m")
    assert a.engine_id != b.engine_id
    assert a.engine_id.startswith(f"{socket.gethostname()}-") and default_engine_id() not in (a.engine_id, b.engine_id)


def _serve(model: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--model", str(model), "--host", "127.0.0.1",
         "--port", "0", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _startup(proc: subprocess.Popen[str]) -> tuple[str, int]:
    """The engine id of the startup log line and the metrics port."""
    assert proc.stdout is not None and proc.stderr is not None
    engine_id, seen = None, []
    for line in proc.stderr:
        seen.append(line)
        found = re.search(r"serving Generate on port \d+ .*engine_id (\S+)\)", line)
        if found:
            engine_id = found.group(1)
            break
    assert engine_id is not None, f"no startup log line; exit {proc.wait()}: {''.join(seen)}"
    for line in proc.stdout:
        if line.startswith("kv-engine: metrics on port "):
            return engine_id, int(line.rsplit(" ", 1)[1])
    proc.kill()
    raise AssertionError(f"no metrics port; exit {proc.wait()}: {proc.stderr.read()}")


def test_two_engines_started_with_defaults_differ(plain_model: Path) -> None:
    procs = [_serve(plain_model), _serve(plain_model)]
    try:
        ids = []
        for proc in procs:
            engine_id, metrics_port = _startup(proc)
            assert engine_id == f"{socket.gethostname()}-{proc.pid}"
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
                body = r.read().decode()
            assert f'kv_engine_info{{engine_id="{engine_id}"}} 1.0' in body
            ids.append(engine_id)
        assert ids[0] != ids[1]
        for proc in procs:
            proc.terminate()
            assert proc.wait(timeout=20) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
