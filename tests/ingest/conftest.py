"""Fixtures for kv-ingest tests: a real offloadd, vLLM-style publishers in this process, kv-ingest
as a subprocess; helpers that read the log back through offloadd."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from events.schema import BlockStored, LogRecord
from events.state import CacheState
from ingest.vllm_publisher import VllmStylePublisher
from offloadd.client import OffloadClient
from tests.support.ingest_proc import IngestProcess
from tests.support.offloadd_proc import DaemonProcess

BLOCK = 4


def stored(*hashes: int, parent: int | None = None, medium: str = "GPU") -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(range(BLOCK * len(hashes))), BLOCK, medium)  # type: ignore[arg-type]


@pytest.fixture
def daemon(tmp_path: Path, redis_url: str) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_path / "d", redis_url, "t" + uuid.uuid4().hex[:10], lease_ms=2_000)
    proc.start()
    yield proc
    proc.kill()


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[OffloadClient]:
    with OffloadClient(daemon.target) as c:
        yield c


@pytest.fixture
def publishers() -> Iterator[list[VllmStylePublisher]]:
    """Publishers a test creates; closed at the end."""
    made: list[VllmStylePublisher] = []
    yield made
    for p in made:
        p.close()


@pytest.fixture
def start_ingest(tmp_path: Path, daemon: DaemonProcess) -> Iterator[Callable[..., IngestProcess]]:
    made: list[IngestProcess] = []

    def start(*specs: str, extra: tuple[str, ...] = ("--idle-sync-s", "0.3")) -> IngestProcess:
        proc = IngestProcess(tmp_path / f"ingest-{len(made)}", daemon.target, list(specs), *extra)
        made.append(proc)
        proc.start()
        return proc

    yield start
    for proc in made:
        proc.stop(kill=True)


def records(client: OffloadClient) -> list[LogRecord]:
    return list(client.subscribe(1))


def state_of(client: OffloadClient) -> CacheState:
    state = CacheState()
    for record in client.subscribe(1):
        state.apply(record)
    return state


def wait_for(check: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.05)


def view_is(client: OffloadClient, want: dict[tuple[str, str, int], frozenset[int]]) -> Callable[[], bool]:
    return lambda: state_of(client).view() == want
