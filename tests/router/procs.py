"""kv-engine (with its HTTP API) and kv-router as real subprocesses on free loopback ports, and
the whole routed stack (Redis, offloadd, kv-bridge, engines, kv-router) for end-to-end tests."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.model.checkpoint import TinyModelSpec, write_tiny_model
from tests.support.bridge_proc import BridgeProcess
from tests.support.child_process import get_json, log_tail, spawn, stop_process, wait_ready
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_proc import RedisProcess, free_port

__all__ = ["Proc", "RoutedStack", "engine", "get_json", "routed_stack", "router"]


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


@dataclass
class RoutedStack:
    engines: list[Proc]
    router: Proc
    bridge: BridgeProcess
    model: Path


@contextlib.contextmanager
def routed_stack(workdir: Path, num_engines: int) -> Iterator[RoutedStack]:
    """Redis, offloadd and kv-bridge, ``num_engines`` engines (``e0``...) on a tiny random model
    offloading to the daemon, and kv-router in front of them following the bridge; all stopped
    on the way out, also when one fails to start."""
    model = write_tiny_model(workdir / "model", TinyModelSpec())
    redis = RedisProcess(workdir / "redis")
    daemon = DaemonProcess(workdir / "offloadd", redis.url, capacity_bytes=8 << 20)
    bridge = BridgeProcess(redis.url, workdir / "bridge", namespace="test")
    procs: list[Proc] = []
    try:
        redis.start()
        daemon.start()
        bridge.start()
        engines = [engine(workdir, f"e{i}", model, daemon.target) for i in range(num_engines)]
        front = router(workdir, engines, f"--bridge-pub={bridge.pub}", f"--bridge-replay={bridge.replay}",
                       f"--model={model}")
        for p in [*engines, front]:
            procs.append(p)
            p.start()
        yield RoutedStack(engines, front, bridge, model)
    finally:
        for p in reversed(procs):
            p.stop()
        bridge.stop()
        daemon.stop()
        redis.stop()
