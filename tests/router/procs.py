"""kv-engine (with its HTTP API) and kv-router as real subprocesses on free loopback ports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.offloadd_proc import stop_process
from tests.support.redis_proc import free_port

REPO = Path(__file__).resolve().parents[2]


def get_json(url: str, timeout_s: float = 2.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


class Proc:
    def __init__(self, name: str, workdir: Path, args: list[str]) -> None:
        self.name = name
        self.port = free_port()
        self.grpc_port = free_port()
        self.log_path = workdir / f"{name}.log"
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> Proc:
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen([sys.executable, "-m", *self.args], stdout=log, stderr=subprocess.STDOUT,
                                     env=env, cwd=REPO)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if get_json(f"{self.url}/health", 0.5)[0] == 200:
                    return self
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not healthy within {timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, kill: bool = False) -> int:
        code = stop_process(self.proc, signal.SIGKILL if kill else signal.SIGTERM, 15.0)
        self.proc = None
        return code


def engine(workdir: Path, name: str, model: Path, offloadd: str | None, *, gpu_blocks: int = 64) -> Proc:
    p = Proc(name, workdir, [])
    p.args = ["engine", "serve", f"--model={model}", "--host=127.0.0.1", f"--port={p.grpc_port}",
              f"--http-port={p.port}", f"--engine-id={name}", f"--num-gpu-blocks={gpu_blocks}",
              "--served-model-name=tiny"]
    if offloadd:
        p.args += [f"--offloadd={offloadd}", "--offload"]
    return p


def router(workdir: Path, engines: list[Proc], *extra: str) -> Proc:
    p = Proc("router", workdir, [])
    p.args = ["router.main", "--host=127.0.0.1", f"--port={p.port}", f"--grpc-port={p.grpc_port}",
              "--served-model-name=tiny", "--health-interval-s=0.3",
              *(f"--engine={e.name}={e.url},grpc=127.0.0.1:{e.grpc_port}" for e in engines), *extra]
    return p
