"""A private redis-server for tests: real Redis on a free loopback port, stoppable and restartable."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path


# Ports handed out below the kernel's ephemeral range (32768-60999 by default), where no
# outgoing connection takes them: a port from bind(0) is an ephemeral one, and on a busy run an
# outgoing connection (a gRPC channel, a Redis client) took one between the pick and the server's
# bind ("Address already in use" in a full CI run). Redis Cluster's bus port (port + 10000) stays
# below 65536. A pytest process hands each port out once; the bind check covers other processes.
def _port_range() -> tuple[int, int]:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return (20000, min(low, 32000)) if low > 22000 else (1024 + 1, 1024 + 1)  # empty: bind(0)


_PORT_RANGE = _port_range()
_handed_out: set[int] = set()
_rng = random.Random(os.getpid() ^ time.monotonic_ns())


def free_port() -> int:
    for _ in range(1000 if _PORT_RANGE[1] > _PORT_RANGE[0] else 0):
        port = _rng.randrange(*_PORT_RANGE)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProcess:
    """redis-server with AOF on, so a stop/start keeps the data (like a real deployment).
    ``appendfsync="always"`` makes every acknowledged write survive a kill -9 too."""

    def __init__(self, workdir: Path, port: int | None = None, password: str | None = None,
                 appendfsync: str = "everysec", extra_args: tuple[str, ...] = ()) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found; run scripts/setup")
        self.exe = exe
        self.workdir = workdir
        self.port = port or free_port()
        self.password = password
        self.appendfsync = appendfsync
        self.extra_args = extra_args  # more redis-server flags (benchmarks: its AOF settings)
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        args = [
            self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
            "--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "",
            "--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        args += self.extra_args
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {log.name}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n" if not self.password else f"AUTH {self.password}\r\nPING\r\n".encode())
                    if b"PONG" in s.recv(64) or (self.password and b"PONG" in s.recv(64)):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
