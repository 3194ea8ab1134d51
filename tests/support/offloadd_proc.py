"""offloadd as a real subprocess for tests: start, wait until gRPC health says SERVING, stop
gracefully (SIGTERM) or kill -9, restart with the same flags (a warm restart)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.redis_proc import free_port

REPO = Path(__file__).resolve().parents[2]


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
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.wait_serving(timeout_s)

    def wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.health_target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"offloadd exited with {self.proc.returncode}:\n{self.log_tail()}"
                    )
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        raise RuntimeError(f"offloadd not serving within {timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

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
