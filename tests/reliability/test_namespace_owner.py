"""One owner per namespace: a second daemon is refused; a paused one that lost the lease
cannot write after the takeover and exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from events.logkeys import LogKeys
from offloadd.client import OffloadClient, OffloadClientError
from offloadd.log.owner import _is_gone, _process_mark
from tests.offloadd.conftest import GROUP, SLOT, chain
from tests.support.offloadd_proc import REPO, DaemonProcess


def _run_to_exit(proc: DaemonProcess) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(proc.args, capture_output=True, text=True, timeout=30, env=env, cwd=REPO)


def test_second_daemon_is_refused(tmp_path: Path, redis_url: str, namespace: str) -> None:
    first = DaemonProcess(tmp_path / "a", redis_url, namespace)
    first.start()
    try:
        second = _run_to_exit(DaemonProcess(tmp_path / "b", redis_url, namespace))
        assert second.returncode == 1
        err = [ln for ln in second.stderr.strip().splitlines() if not ln.startswith("{")]
        assert len(err) == 1, second.stderr
        assert err[0].startswith(
            f"offloadd: namespace '{namespace}' is owned by another daemon (token 1, lease expires in ")
        assert err[0].endswith(" s); stop it or wait")
        assert "Traceback" not in second.stdout + second.stderr
        with OffloadClient(first.target) as c:  # the first one is untouched
            c.register_engine("e", 1, "m", [GROUP])
    finally:
        assert first.stop() == 0
    client = redis.Redis.from_url(redis_url)
    assert client.exists(LogKeys(namespace).owner) == 0  # released on a graceful stop
    client.close()
    restarted = DaemonProcess(tmp_path / "b", redis_url, namespace)
    restarted.start()  # released: no waiting
    restarted.kill()


def test_kill9_restart_takes_the_lease_of_the_dead_process(
    tmp_path: Path, redis_url: str, namespace: str
) -> None:
    proc = DaemonProcess(tmp_path / "a", redis_url, namespace, extra_args=("--owner-lease-s", "60"))
    proc.start()
    proc.kill()
    t0 = time.monotonic()
    proc.restart()  # same host and pid namespace, holder gone: no 60 s wait
    assert time.monotonic() - t0 < 30
    proc.kill()


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _wait_zombie(pid: int) -> None:
    deadline = time.monotonic() + 10
    while _state(pid) != "Z":
        assert time.monotonic() < deadline, f"{pid} is {_state(pid)}, not a zombie"
        time.sleep(0.01)


def test_an_unreaped_zombie_holder_is_gone() -> None:
    """A killed process whose parent has not waited for it keeps its /proc entry and start time,
    but runs nothing: its lease is free to take. While it runs, it is not."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        value = f"7:daemon-id:{_process_mark(child.pid)}"
        assert not _is_gone(value)
        child.kill()  # not waited for: a zombie until child.wait()
        _wait_zombie(child.pid)
        assert _is_gone(value)
    finally:
        child.kill()
        child.wait()
    assert _is_gone(value)  # reaped: no /proc entry at all


# Runs the daemon (argv) as a child it reaps only once a line comes on stdin.
_NO_REAP = "import subprocess, sys; p = subprocess.Popen(sys.argv[1:]); sys.stdin.readline(); p.wait()"


def test_kill9_restart_takes_the_lease_of_an_unreaped_daemon(
    tmp_path: Path, redis_url: str, namespace: str
) -> None:
    """A daemon killed under a parent that does not wait (a profiler, a container init that
    reaps nothing) is a zombie: the restart takes its lease instead of waiting the TTL out."""
    lease = ("--owner-lease-s", "60")
    first = DaemonProcess(tmp_path / "a", redis_url, namespace, extra_args=lease)
    with open(first.log_path, "wb") as out:
        parent = subprocess.Popen([sys.executable, "-c", _NO_REAP, *first.args], stdin=subprocess.PIPE,
                                  stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
    assert parent.stdin is not None
    first.proc = parent
    second = DaemonProcess(tmp_path / "b", redis_url, namespace, extra_args=lease)
    try:
        first.wait_serving(30)
        (daemon_pid,) = map(int, Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split())
        os.kill(daemon_pid, signal.SIGKILL)
        _wait_zombie(daemon_pid)
        t0 = time.monotonic()
        second.start()
        assert time.monotonic() - t0 < 30  # not the lease's 60 s
        owner: bytes | None = redis.Redis.from_url(redis_url).get(LogKeys(namespace).owner)  # type: ignore[assignment]
        assert owner is not None and owner.startswith(b"2:")
        assert "held by a process that is gone; taking it" in second.log_tail()
    finally:
        second.kill()
        parent.stdin.write(b"\n")
        parent.stdin.close()
        parent.wait(timeout=10)
        first.proc = None


def test_paused_owner_cannot_write_after_takeover(tmp_path: Path, redis_url: str, namespace: str) -> None:
    lease = ("--owner-lease-s", "1")
    first = DaemonProcess(tmp_path / "a", redis_url, namespace, capacity_bytes=16 * SLOT, extra_args=lease)
    second = DaemonProcess(tmp_path / "b", redis_url, namespace, capacity_bytes=16 * SLOT, extra_args=lease)
    admin = redis.Redis.from_url(redis_url)
    keys = LogKeys(namespace)
    first.start()
    try:
        with OffloadClient(first.target, timeout_s=3.0) as c:
            c.register_engine("e", 1, "m", [GROUP])
            res = c.reserve("e", 0, chain(1))
            assert first.proc is not None
            first.proc.send_signal(signal.SIGSTOP)
            time.sleep(1.5)  # past the lease: nothing renews it
            second.start()
            head = int(admin.get(keys.head) or 0)
            entries = admin.xlen(keys.log)
            owner: bytes | None = admin.get(keys.owner)  # type: ignore[assignment]
            assert owner is not None and owner.startswith(b"2:")
            first.proc.send_signal(signal.SIGCONT)
            with pytest.raises(OffloadClientError):
                c.commit("e", res.reservation_id)
        assert first.proc.wait(timeout=15) == 3
        first.proc = None
        assert "no longer owned" in first.log_tail() or "lost the owner lease" in first.log_tail()
        assert int(admin.get(keys.head) or 0) == head  # nothing from the old owner
        assert admin.xlen(keys.log) == entries
        assert admin.get(keys.owner) == owner
    finally:
        admin.close()
        first.kill()
        second.kill()
