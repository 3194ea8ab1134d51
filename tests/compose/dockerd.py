"""A private dockerd for tests/compose (Debian's docker.io): its data root in the cache folder, so
images and build layers outlive a run, and its exec root, socket and log in a temp folder. No
iptables and no default bridge: the machine's firewall is never touched. Two kinds:
- on the machine's network, for builds (pip reaches the registry; builds use the host network);
- in a network namespace of its own (``own_netns``), for running the stack: compose's bridge
  network, its published ports (docker-proxy) and its containers' addresses exist only there, so
  nothing meets the machine's ports or addresses; a client joins it with ``nsenter --net``.
Stopped by its PID, then whatever it left (its containerd and shims, found by PID; its mounts) is
ended and unmounted, and the temp folder removed, also when a test failed."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


class DockerdUnavailable(Exception):
    """No Docker daemon can start here (the one case where tests/compose skips)."""


@dataclass
class Dockerd:
    proc: subprocess.Popen[bytes]
    run_dir: Path
    data_root: Path

    @property
    def sock(self) -> Path:
        return self.run_dir / "docker.sock"

    @property
    def log(self) -> Path:
        return self.run_dir / "dockerd.log"

    @property
    def netns(self) -> str:
        """The daemon's network namespace, for ``nsenter --net=``."""
        return f"/proc/{self.proc.pid}/ns/net"

    def env(self, docker_config: Path) -> dict[str, str]:
        """The environment for the docker CLI: this daemon, our private CLI plugins."""
        return {**os.environ, "DOCKER_HOST": f"unix://{self.sock}", "DOCKER_CONFIG": str(docker_config)}

    def log_tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 60) -> list[str]:
        """SIGTERM the daemon (it stops its containers and its containerd), SIGKILL after
        ``grace_s``; then end what is left of ours by PID and unmount. Returns what had to be
        cleaned up after the daemon itself (empty when it stopped cleanly)."""
        leftovers: list[str] = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                leftovers.append(f"dockerd {self.proc.pid} ignored SIGTERM for {grace_s} s")
                self.proc.kill()
                self.proc.wait(30)
        for pid in _pids_mentioning(str(self.run_dir)):
            leftovers.append(f"process {pid}: {_cmdline(pid)[:120]}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for mount in _mounts_under(self.run_dir, self.data_root):
            leftovers.append(f"mount {mount}")
            subprocess.run(["umount", "-l", mount], capture_output=True, timeout=30)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return leftovers


def start_dockerd(run_dir: Path, data_root: Path, *, own_netns: bool = False, timeout_s: float = 90) -> Dockerd:
    """Start dockerd and wait until it answers /_ping; DockerdUnavailable if it cannot."""
    binary = shutil.which("dockerd")
    if binary is None:
        raise DockerdUnavailable("dockerd is not installed (scripts/compose-setup installs docker.io)")
    if own_netns and not (shutil.which("unshare") and shutil.which("ip")):
        raise DockerdUnavailable("unshare (util-linux) and ip (iproute2) are needed for its own network namespace")
    data_root.mkdir(parents=True, exist_ok=True)
    (run_dir / "exec").mkdir(parents=True)
    (run_dir / "daemon.json").write_text(json.dumps({}))  # not the machine's /etc/docker one
    argv = [
        binary, "--config-file", str(run_dir / "daemon.json"),
        "--data-root", str(data_root), "--exec-root", str(run_dir / "exec"),
        "--pidfile", str(run_dir / "docker.pid"), "--host", f"unix://{run_dir / 'docker.sock'}",
        "--iptables=false", "--ip6tables=false", "--bridge=none",
    ]
    if own_netns:  # a new namespace has only a loopback, down: bring it up, then become dockerd
        argv = ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', *argv]
    with open(run_dir / "dockerd.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    daemon = Dockerd(proc, run_dir, data_root)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = daemon.log_tail(15)
            daemon.stop()
            raise DockerdUnavailable(f"dockerd exited with {proc.returncode}:\n{tail}")
        if _ping(daemon.sock):
            return daemon
        time.sleep(0.2)
    tail = daemon.log_tail(15)
    daemon.stop()
    raise DockerdUnavailable(f"dockerd did not answer within {timeout_s:.0f} s:\n{tail}")


def _ping(sock: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(str(sock))
            s.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return s.recv(4096).endswith(b"OK")
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pids_mentioning(path: str) -> list[int]:
    """Processes whose command line names ``path`` (the daemon's containerd and shims)."""
    me = os.getpid()
    return [int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and int(p.name) != me and path in _cmdline(int(p.name))]


def _mounts_under(*roots: Path) -> list[str]:
    """Mount points below ``roots``, deepest first."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if any(point.startswith(f"{r}/") for r in roots):
            found.append(point)
    return sorted(found, key=len, reverse=True)
