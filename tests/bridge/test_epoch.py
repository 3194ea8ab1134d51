"""A new log epoch under a running bridge (bridge.epoch), with a plain log writer.

The log is replaced (its keys deleted, a new epoch set, new records from offset 1): the bridge
publishes one AllBlocksCleared batch per source it knew, then the new records, seqs continuing;
/healthz is 503 while the epoch is gone; a replay from an old seq starts with the clear
batches; a restarted bridge continues the same numbering.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from events.codec_vllm import WireBatch
from events.logkeys import LogKeys
from events.schema import AllBlocksCleared, BlockStored
from events.state import CacheState
from events.subscriber import KvEventSubscriber
from tests.support.bridge_proc import BridgeProcess, LogWriter


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def _stored(h: int) -> BlockStored:
    return BlockStored((h,), None, (1, 2, 3, 4), 4, "GPU")


def _wait(predicate: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_new_epoch_is_signalled_and_seqs_continue(
    client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    ns = "ep" + uuid.uuid4().hex[:8]
    keys = LogKeys(ns)
    client.set(keys.epoch, "old")
    writer = LogWriter(client, ns)
    for i in range(5):
        writer.append(f"e{i % 2}", [_stored(100 + i)])
    bridge = BridgeProcess(redis_url, tmp_path / "b", "--start", "beginning", namespace=ns)
    bridge.start()
    sub = KvEventSubscriber(bridge.pub, bridge.replay, idle_sync_s=0.3, replay_timeout_s=2.0)
    seen: list[tuple[int, WireBatch]] = []
    sub.on_batch(lambda seq, batch: seen.append((seq, batch)))
    try:
        time.sleep(0.3)
        sub.replay_from(0)
        assert [s for s, _ in seen] == [0, 1, 2, 3, 4]

        client.delete(keys.log, keys.head, keys.epoch)  # Redis lost the log
        assert _wait(lambda: bridge.health()[0] == 503, 5)
        assert "re-syncing" in bridge.health()[1]["detail"]
        client.set(keys.epoch, "new")
        writer = LogWriter(client, ns)
        new = [writer.append("e1", [_stored(200 + i)], source_seq=i + 1) for i in range(3)]
        want = CacheState()
        for r in new:
            want.apply(r)
        assert sub.run_until(lambda s: s.state.view() == want.view(), 10), sub.state.view()
        assert _wait(lambda: bridge.health()[0] == 200, 5), bridge.health()

        assert [s for s, _ in seen] == list(range(10))
        clears = [(b.sources, b.events) for _, b in seen[5:7]]
        assert clears == [(("e0",), (AllBlocksCleared(),)), (("e1",), (AllBlocksCleared(),))]
        assert [b.events for _, b in seen[7:]] == [r.events for r in new]

        # A replay from a seq of the old epoch: the clear batches first, then the new log.
        late = KvEventSubscriber(bridge.pub, bridge.replay, replay_timeout_s=2.0)
        got: list[int] = []
        late.on_batch(lambda seq, _b: got.append(seq))
        late.replay_from(3)
        late.close()
        assert got == [5, 6, 7, 8, 9]

        # A restarted bridge continues the numbering of the new epoch.
        bridge.stop()
        bridge.start()
        writer.append("e0", [_stored(300)])
        assert sub.run_until(lambda s: s.next_seq == 11, 10), (sub.next_seq, bridge.output()[-2000:])
        assert seen[-1][0] == 10 and sub.stats.lost == 0
    finally:
        sub.close()
        bridge.stop()
