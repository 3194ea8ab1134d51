"""offloadd as a real subprocess for tests: start, wait until gRPC health says SERVING, stop
gracefully (SIGTERM) or kill -9, restart with the same flags (a warm restart)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.child_process import REPO, log_tail, spawn, stop_process, wait_ready
from tests.support.redis_proc import free_port

__all__ = ["REPO", "DaemonProcess", "stop_process"]


class DaemonProcess:
    """``python -m offloadd`` with an arena dir under the test's tmp dir (never /dev/shm)."""

    def __init__(
        self, workdir: Path, redis_url: str, namespace: str = "test", *,
        capacity_bytes: int = 1 << 20, chunk_bytes: int | None = None,
        lease_ms: int = 30_000, extra_args: tuple[str, ...] = (), metrics: bool = False,
    ) -> None:
        self.workdir = workdir
        self.arena_dir = workdir / "arena"
        self.redis_url = redis_url
        self.namespace = namespace
        self.port = free_port()
        self.metrics_port = free_port() if metrics else -1
        self.unix_socket = str(workdir / "offloadd.sock")
        self.args = [
            sys.executable, "-m", "offloadd",
            "--grpc-host", "127.0.0.1", "--grpc-port", str(self.port),
            "--unix-socket", self.unix_socket,
            "--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port),
            "--redis-url", redis_url, "--namespace", namespace,
            "--arena-dir", str(self.arena_dir), "--capacity-bytes", str(capacity_bytes),
            "--chunk-bytes", str(chunk_bytes or capacity_bytes), "--lease-ms", str(lease_ms),
            "--redis-timeout-s", "1.0", "--grace-s", "1.0", "--sweep-interval-ms", "50",
            *extra_args,
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.poll_s = 0.05  # between readiness probes (a benchmark timing starts polls finer)
        self.log_path = workdir / "offloadd.log"
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def health_target(self) -> str:
        """Where readiness is probed (plaintext); TLS-only daemons probe their unix socket."""
        return self.target

    def start(self, timeout_s: float = 20.0) -> None:
        self.proc = spawn(self.args, self.log_path)
        self.wait_serving(timeout_s)

    def wait_serving(self, timeout_s: float) -> None:
        assert self.proc is not None, "start() first"
        # gRPC waits 1 s, then 1.6 s... before reconnecting after a refused connection: without
        # a short backoff, SERVING would be seen up to ~1.6 s late (a restart looked 1 s slower).
        options = [("grpc.initial_reconnect_backoff_ms", 20), ("grpc.max_reconnect_backoff_ms", 20),
                   ("grpc.use_local_subchannel_pool", 1)]
        with grpc.insecure_channel(self.health_target, options=options) as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def is_serving() -> bool:
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                except grpc.RpcError:
                    return False
                return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

            wait_ready(self.proc, is_serving, name="offloadd", timeout_s=timeout_s, output=self.log_tail,
                       poll_s=self.poll_s)

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        code = stop_process(self.proc, signal.SIGTERM, timeout_s)
        self.proc = None
        return code

    def kill(self) -> None:
        """kill -9: no cleanup at all, as in a crash."""
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    def restart(self, timeout_s: float = 20.0) -> None:
        self.start(timeout_s)
