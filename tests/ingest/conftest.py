"""Fixtures for kv-ingest tests: a real offloadd, vLLM-style publishers in this process, kv-ingest
as a subprocess; helpers that read the log back through offloadd."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from events.schema import BlockStored, Event, LogRecord
from events.state import CacheState
from ingest.vllm_publisher import VllmStylePublisher
from offloadd.client import OffloadClient
from tests.support.ingest_proc import IngestProcess, vllm_endpoints
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


@dataclass
class Pod:
    """``pod-a``: a vLLM-style publisher on free loopback ports and the kv-ingest following it."""

    vllm: VllmStylePublisher
    ingest: IngestProcess
    spec: str  # kv-ingest's ``--vllm`` spec for it
    pub: str
    replay: str | None


@pytest.fixture
def pod_a(
    publishers: list[VllmStylePublisher], start_ingest: Callable[..., IngestProcess],
) -> Callable[..., Pod]:
    """Makes ``pod-a``: ``replay=False`` gives the publisher no replay socket; ``first`` batches are
    published before kv-ingest starts (it finds them in the ring at first contact); ``extra`` are
    kv-ingest's flags; other keywords go to :class:`VllmStylePublisher`."""

    def make(*, replay: bool = True, first: Sequence[Sequence[Event]] = (),
             extra: tuple[str, ...] | None = None, **publisher_kw: Any) -> Pod:
        pub, replay_ep = vllm_endpoints()
        replay_at = replay_ep if replay else None
        vllm = VllmStylePublisher(pub, replay_at, **publisher_kw)
        publishers.append(vllm)
        for batch in first:
            vllm.publish(batch)
        spec = f"pod-a={pub}" + (f",replay={replay_ep}" if replay else "")
        ingest = start_ingest(spec) if extra is None else start_ingest(spec, extra=extra)
        return Pod(vllm, ingest, spec, pub, replay_at)

    return make


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
