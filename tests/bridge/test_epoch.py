"""A new log epoch under a running bridge (bridge.epoch), with a plain log writer.

The log is replaced (its keys deleted, a new epoch set, new records from offset 1): the bridge
publishes one AllBlocksCleared batch per source it knew, then the new records, seqs continuing;
/healthz is 503 while the epoch is gone; a replay from an old seq starts with the clear
batches; a restarted bridge continues the same numbering.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import msgspec
import redis
import zmq

from events.codec_vllm import WireBatch
from events.logkeys import LogKeys
from events.schema import AllBlocksCleared, BlockStored
from events.state import CacheState
from events.subscriber import KvEventSubscriber
from tests.events.vllm_schema import LegacyBatch
from tests.support.bridge_proc import BridgeProcess, LogWriter
from tests.support.redis_proc import free_port


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


def test_new_epoch_on_the_legacy_pair(client: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    """--legacy-pub: the clear batches of a new epoch go out in the legacy layout too, live and
    in replay, under the same seqs as on the map-layout pair."""
    ns = "ep" + uuid.uuid4().hex[:8]
    keys = LogKeys(ns)
    client.set(keys.epoch, "old")
    writer = LogWriter(client, ns)
    for i in range(3):
        writer.append(f"e{i % 2}", [_stored(100 + i)])
    legacy_pub, legacy_replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    bridge = BridgeProcess(redis_url, tmp_path / "b", "--start", "beginning", "--legacy-pub",
                           legacy_pub, "--legacy-replay", legacy_replay, namespace=ns)
    bridge.start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        sub.connect(legacy_pub)
        time.sleep(0.3)  # joined before the epoch changes
        client.delete(keys.log, keys.head, keys.epoch)
        assert _wait(lambda: bridge.health()[0] == 503, 5)
        client.set(keys.epoch, "new")
        LogWriter(client, ns).append("e1", [_stored(200)], source_seq=1)
        live = []
        while len(live) < 3:
            assert sub.poll(5000), f"only {len(live)} legacy batches arrived"
            live.append(sub.recv_multipart())
        decode = msgspec.msgpack.Decoder(LegacyBatch).decode
        assert [int.from_bytes(f[1], "big") for f in live] == [3, 4, 5]
        assert [type(e).__name__ for f in live for e in decode(f[2]).events] == [
            "LAllBlocksCleared", "LAllBlocksCleared", "LBlockStored"]
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(legacy_replay)
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            if frames[3] == b"":
                break
            replayed.append((int.from_bytes(frames[2], "big"), decode(frames[3]).events))
        assert [s for s, _ in replayed] == [3, 4, 5]  # seq 2 was the old log's: the clears first
        assert [e for _, ev in replayed for e in ev] == [e for f in live for e in decode(f[2]).events]
    finally:
        ctx.destroy(linger=0)
        bridge.stop()
