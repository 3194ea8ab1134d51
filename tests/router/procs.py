"""kv-engine (with its HTTP API) and kv-router as real subprocesses on free loopback ports."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.support.child_process import get_json, log_tail, spawn, stop_process, wait_ready
from tests.support.redis_proc import free_port

__all__ = ["Proc", "engine", "get_json", "router"]


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
        self.proc = spawn([sys.executable, "-m", *self.args], self.log_path)
        wait_ready(self.proc, lambda: get_json(f"{self.url}/health", 0.5)[0] == 200, name=self.name,
                   timeout_s=timeout_s, output=self.log_tail, poll_s=0.1)
        return self

    def log_tail(self, n: int = 30) -> str:
        return log_tail(self.log_path, n)

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
