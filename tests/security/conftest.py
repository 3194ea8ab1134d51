"""Fixtures for the security tests: throwaway PKI, token files, a daemon subprocess whose
readiness is probed over its unix socket (its TCP port may speak TLS only)."""

from __future__ import annotations

import grp
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.security.pki import Pki, make_pki
from tests.support.offloadd_proc import DaemonProcess

TOKEN = "s3cr3t-token-" + "x" * 20
WRONG_TOKEN = "s3cr3t-token-" + "y" * 20


class SecureDaemon(DaemonProcess):
    """DaemonProcess that waits for SERVING on the plaintext unix socket."""

    @property
    def health_target(self) -> str:
        return f"unix:{self.unix_socket}"


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def other_group() -> tuple[str, int]:
    """A group the daemon may chown to other than its own primary group (any group as root),
    so the test sees the group change; the primary group when there is no other."""
    for g in grp.getgrall():
        if g.gr_gid != os.getgid() and (os.geteuid() == 0 or g.gr_gid in os.getgroups()):
            return g.gr_name, g.gr_gid
    return grp.getgrgid(os.getgid()).gr_name, os.getgid()


def write_token(path: Path, token: str) -> str:
    path.write_text(token + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def token_file(tmp_path: Path) -> str:
    return write_token(tmp_path / "token", TOKEN)


@pytest.fixture
def namespace() -> str:
    return "s" + uuid.uuid4().hex[:10]


def start_daemon(workdir: Path, redis_url: str, namespace: str, *args: str) -> SecureDaemon:
    proc = SecureDaemon(workdir, redis_url, namespace, capacity_bytes=1 << 16, extra_args=args)
    proc.start()
    return proc


@pytest.fixture
def stop_after() -> Iterator[list[DaemonProcess]]:
    """Daemons appended here are stopped (SIGTERM) at the end of the test."""
    procs: list[DaemonProcess] = []
    yield procs
    for p in procs:
        p.stop()
