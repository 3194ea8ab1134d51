"""kv-ingest as a real subprocess for tests and benchmarks: start, wait for ``/healthz``,
read ``/metrics``, stop with SIGTERM or kill -9."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.child_process import get_json, spawn, stop_process, wait_ready
from tests.support.redis_proc import free_port


def vllm_endpoints() -> tuple[str, str]:
    """A PUB and a replay endpoint on free loopback ports."""
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


class IngestProcess:
    """``python -m ingest`` following the given ``--vllm`` specs into offloadd at ``target``."""

    def __init__(self, workdir: Path, target: str, specs: list[str], *extra: str) -> None:
        self.workdir = workdir
        self.metrics_port = free_port()
        self.args = [
            sys.executable, "-m", "ingest", "--offloadd", target,
            "--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port),
            *[a for spec in specs for a in ("--vllm", spec)], *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def log_path(self) -> Path:
        return self.workdir / f"ingest-{self.runs}.log"

    def start(self, timeout_s: float = 15.0, wait_healthy: bool = False) -> None:
        """Start; by default wait only until ``/healthz`` answers (healthy needs a publisher)."""
        self.runs += 1
        self.proc = spawn(self.args, self.log_path, append=False)
        wait_ready(self.proc, lambda: self.health()[0] == 200 or not wait_healthy, name="kv-ingest",
                   timeout_s=timeout_s, output=self.output)

    def health(self) -> tuple[int, dict[str, Any]]:
        status, body = get_json(f"http://127.0.0.1:{self.metrics_port}/healthz", 1.0)
        return status, body

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` (a counter's ``_total``) whose labels include ``labels``."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            text = resp.read().decode()
        total = 0.0
        for m in re.finditer(rf"^{re.escape(name)}(?:{{(.*?)}})? (\S+)$", text, re.M):
            have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m[1] or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(m[2])
        return total

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, kill: bool = False, timeout_s: float = 15.0) -> int:
        code = stop_process(self.proc, signal.SIGKILL if kill else signal.SIGTERM, timeout_s)
        self.proc = None
        return code
