"""A private redis-server for tests: real Redis on a free loopback port, stoppable and restartable."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProcess:
    """redis-server with AOF on, so a stop/start keeps the data (like a real deployment).
    ``appendfsync="always"`` makes every acknowledged write survive a kill -9 too."""

    def __init__(self, workdir: Path, port: int | None = None, password: str | None = None,
                 appendfsync: str = "everysec") -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found; run scripts/setup")
        self.exe = exe
        self.workdir = workdir
        self.port = port or free_port()
        self.password = password
        self.appendfsync = appendfsync
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
