"""Starts local processes with readiness checks, logs each to the run directory, and stops them
all (in reverse order, SIGTERM then SIGKILL) when asked or when one of them dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ReadyCheck = Callable[[], tuple[bool, str]]


class StackError(RuntimeError):
    """A process of the stack failed to start or died."""


@dataclass
class Managed:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path


@dataclass
class Supervisor:
    run_dir: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    procs: list[Managed] = field(default_factory=list)

    def start(self, name: str, argv: Sequence[str], ready: ReadyCheck | None = None,
              timeout_s: float = 60.0) -> Managed:
        log_path = self.run_dir / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True)
        log.close()
        managed = Managed(name, proc, log_path)
        self.procs.append(managed)
        print(f"  {name:<10} pid {proc.pid:<7} log {log_path}", flush=True)
        if ready is not None:
            self.wait_ready(managed, ready, timeout_s)
        return managed

    def run_once(self, name: str, argv: Sequence[str], timeout_s: float = 300.0) -> None:
        """Run a setup step to completion, its output in the run directory's log."""
        log_path = self.run_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            try:
                rc = subprocess.run(list(argv), stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                    timeout=timeout_s).returncode
            except subprocess.TimeoutExpired as exc:
                raise StackError(f"{name} took longer than {timeout_s:.0f}s") from exc
        if rc != 0:
            raise StackError(f"{name} failed with code {rc}; last log lines:\n{tail(log_path)}")

    def wait_ready(self, managed: Managed, ready: ReadyCheck, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        why = "not checked"
        while time.monotonic() < deadline:
            if managed.proc.poll() is not None:
                raise StackError(f"{managed.name} exited with code {managed.proc.returncode}; "
                                 f"last log lines:\n{tail(managed.log_path)}")
            ok, why = ready()
            if ok:
                return
            time.sleep(0.2)
        raise StackError(f"{managed.name} not ready after {timeout_s:.0f}s ({why}); "
                         f"last log lines:\n{tail(managed.log_path)}")

    def check_alive(self) -> None:
        for m in self.procs:
            if m.proc.poll() is not None:
                raise StackError(f"{m.name} died with code {m.proc.returncode}; "
                                 f"last log lines:\n{tail(m.log_path)}")

    def stop_all(self, grace_s: float = 10.0) -> None:
        for m in reversed(self.procs):
            if m.proc.poll() is None:
                m.proc.send_signal(signal.SIGTERM)
                try:
                    m.proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    print(f"  {m.name} ignored SIGTERM for {grace_s:.0f}s; killing", file=sys.stderr)
                    m.proc.kill()
                    m.proc.wait()
        self.procs.clear()


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])
