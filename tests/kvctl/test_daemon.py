"""With the real writer: offloadd appends engine batches to the log; ``kvctl replay --at N``
equals the state the daemon reported at offset N, and a bridge subscriber's snapshot equals the
daemon's current state."""

from __future__ import annotations

import json
import queue
import random
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kvcache.v1 import events_pb2, log_pb2, log_pb2_grpc

from events.codec_proto import EventBatch, batch_to_proto, snapshot_from_proto
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, Event
from events.state import CacheState
from events.subscriber import KvEventSubscriber
from kvctl.main import main as kvctl
from tests.support.bridge_proc import BridgeProcess
from tests.support.offloadd_proc import DaemonProcess

NAMESPACE = "kvctl"


@pytest.fixture
def daemon(redis_url: str, tmp_path: Path) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_path / "offloadd", redis_url, NAMESPACE)
    proc.start()
    yield proc
    proc.stop()


class Engine:
    """An engine's GPU tier as a sequence of fenced batches (chains, evictions, a reset)."""

    def __init__(self, engine_id: str, seed: int) -> None:
        self.engine_id, self.rng, self.seq = engine_id, random.Random(seed), 0
        self.held: list[int] = []
        self.next_hash = seed * 1_000_000

    def step(self) -> events_pb2.EventBatch:
        events: list[Event]
        roll = self.rng.random()
        if self.held and roll < 0.25:
            victims = tuple(self.held[-2:])
            del self.held[-2:]
            events = [BlockRemoved(victims, "GPU")]
        elif roll > 0.97:
            self.held.clear()
            events = [AllBlocksCleared("GPU")]
        else:
            parent = self.held[-1] if self.held else None
            hashes = tuple(range(self.next_hash, self.next_hash + 3))
            self.next_hash += 3
            self.held.extend(hashes)
            events = [BlockStored(hashes, parent, tuple(range(12)), 4, "GPU")]
        self.seq += 1
        return batch_to_proto(EventBatch(self.engine_id, 1, self.seq, time.time(), tuple(events)))


class Publisher:
    """One Publish stream kept open for the whole test: the engines stay alive (a stream that
    ends is their departure, and the daemon would log their GPU tiers cleared)."""

    def __init__(self, target: str) -> None:
        self._queue: queue.Queue[events_pb2.EventBatch | None] = queue.Queue()
        self._channel = grpc.insecure_channel(target)
        self._acks = log_pb2_grpc.EventIngestStub(self._channel).Publish(
            iter(self._queue.get, None), timeout=120)

    def publish(self, engines: list[Engine], n: int) -> None:
        for i in range(n):
            self._queue.put(engines[i % len(engines)].step())
        acks = [next(self._acks) for _ in range(n)]
        assert all(a.status == log_pb2.PublishAck.STATUS_APPLIED for a in acks), acks

    def close(self) -> None:
        self._queue.put(None)
        self._channel.close()


def _daemon_state(target: str) -> CacheState:
    with grpc.insecure_channel(target) as ch:
        resp = log_pb2_grpc.EventLogStub(ch).Snapshot(log_pb2.SnapshotRequest(), timeout=10)
    return CacheState.from_snapshot(snapshot_from_proto(resp))


def _from_json(doc: dict[str, object]) -> tuple[dict[tuple[str, str, int], frozenset[int]], dict[str, object]]:
    view, fences = {}, {}
    for source, body in doc["sources"].items():  # type: ignore[attr-defined]
        fences[source] = tuple(body["fence"]) if body["fence"] else None
        for tier in body["tiers"]:
            view[(source, tier["medium"], tier["group_idx"])] = frozenset(tier["blocks"])
    return view, fences


def test_kvctl_replay_at_n_equals_the_daemons_state_at_n(
    daemon: DaemonProcess, redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engines = [Engine("engine-a", 1), Engine("engine-b", 2)]
    publisher = Publisher(daemon.target)
    publisher.publish(engines, 40)
    at_40 = _daemon_state(daemon.target)
    assert at_40.offset == 40
    publisher.publish(engines, 25)

    assert kvctl(["replay", redis_url, "--namespace", NAMESPACE, "--at", "40", "--json"]) == 0
    view, fences = _from_json(json.loads(capsys.readouterr().out))
    assert view == at_40.view()
    assert fences == {s: at_40.fence(s) for s in at_40.sources()}
    assert kvctl(["verify", redis_url, "--namespace", NAMESPACE]) == 0
    assert capsys.readouterr().out.startswith("verify: OK: 65 records, last offset 65")

    bridge = BridgeProcess(redis_url, tmp_path / "bridge", namespace=NAMESPACE)
    bridge.start()
    try:
        with KvEventSubscriber(bridge.pub, bridge.replay) as sub:
            assert sub.bootstrap() == 65
            now = _daemon_state(daemon.target)
            assert sub.view() == now.view()
            publisher.publish(engines, 15)  # and live, through the bridge
            assert sub.run_until(lambda s: s.next_seq == 80)
            assert sub.view() == _daemon_state(daemon.target).view()
    finally:
        bridge.stop()
        publisher.close()
