"""Fixtures for offloadd tests: a real daemon subprocess per test on its own namespace."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from offloadd.client import BlockToStore, GroupSpec, OffloadClient
from tests.support.offloadd_proc import DaemonProcess

SLOT = 256  # tiny slots keep the arena small and the tests fast
GROUP = GroupSpec(0, "full_attention", 0, 4, SLOT, "uint8", "test-layout")


def digest(i: int, salt: str = "") -> bytes:
    return hashlib.sha256(f"{salt}{i}".encode()).digest()


def chain(n: int, salt: str = "", start: int = 0) -> list[BlockToStore]:
    """``n`` blocks of one chain: block i's parent is block i-1."""
    out = []
    for i in range(start, start + n):
        parent = digest(i - 1, salt) if i > 0 else None
        out.append(BlockToStore(digest(i, salt), parent, (i, i + 1, i + 2, i + 3)))
    return out


def pattern(slot_tag: int, n: int = SLOT) -> bytes:
    return bytes((slot_tag * 7 + k) % 251 for k in range(n))


@pytest.fixture
def namespace() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def daemon(tmp_path: Path, redis_url: str, namespace: str) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=16 * SLOT)
    proc.start()
    yield proc
    proc.kill()


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[OffloadClient]:
    with OffloadClient(daemon.target) as c:
        yield c
