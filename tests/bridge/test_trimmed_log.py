"""A bridge on a log the daemon trimmed behind its checkpoints (DESIGN.md 3.5-3.6): its state
starts from the newest checkpoint plus the tail, so its snapshot equals the daemon's; a bridge
whose saved position was trimmed jumps to the checkpoint (seq = offset - 1)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import redis

from events.logkeys import LogKeys
from events.schema import BlockRemoved, BlockStored, Event
from events.state import CacheState
from events.subscriber import KvEventSubscriber
from offloadd.client import IngestStream, OffloadClient
from tests.support.bridge_proc import BridgeProcess
from tests.support.offloadd_proc import DaemonProcess

CKPT_ARGS = ("--checkpoint-interval-s", "0.2", "--checkpoint-records", "50",
             "--retention-records", "20", "--retention-s", "0")


def publish(stream: IngestStream, start: int, n: int) -> None:
    """``n`` records: one GPU block each; every fifth removes a block stored five before."""
    for i in range(start, start + n):
        events: list[Event] = [BlockStored((i,), None, (1, 2, 3, 4), 4, "GPU")]
        if i % 5 == 4:
            events.append(BlockRemoved((i - 4,), "GPU"))
        stream.submit(events)
    assert stream.flush(60)


def publish_until_trimmed(stream: IngestStream, admin: Any, keys: LogKeys, start: int, past: int,
                          timeout_s: float = 20) -> tuple[int, int]:
    """Publish 10 records at a time until the log's first offset is past ``past`` (the trim
    waits for a second checkpoint after it); (the log's first offset, the next record index)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        entries = admin.xrange(keys.log, "-", "+", count=1)
        first = int(entries[0][0].split(b"-")[0]) if entries else 0
        if first > past and admin.get(keys.checkpoint):
            return first, start
        publish(stream, start, 10)
        start += 10
        time.sleep(0.3)
    raise AssertionError(f"the log was not trimmed past {past} within {timeout_s}s")


def bootstrap_at(sub: KvEventSubscriber, offset: int, timeout_s: float = 10) -> None:
    """Snapshot until the bridge has published through ``offset`` (seq = offset - 1)."""
    deadline = time.monotonic() + timeout_s
    while (seq := sub.bootstrap()) != offset:
        assert seq < offset and time.monotonic() < deadline, seq
        time.sleep(0.05)


def daemon_state(proc: DaemonProcess) -> CacheState:
    with OffloadClient(proc.target) as c:
        return CacheState.from_snapshot(c.snapshot())


def test_bridge_on_a_trimmed_log_serves_the_daemons_state(
    tmp_path: Path, redis_url: str,
) -> None:
    namespace = "trim" + uuid.uuid4().hex[:8]
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, extra_args=CKPT_ARGS)
    keys, admin = LogKeys(namespace), redis.Redis.from_url(redis_url)
    proc.start()
    stream = IngestStream(proc.target, "gpu-engine", 3)
    bridge = BridgeProcess(redis_url, tmp_path / "b", namespace=namespace)
    try:
        publish(stream, 0, 300)
        _, at = publish_until_trimmed(stream, admin, keys, 300, 100)
        now = daemon_state(proc)
        bridge.start()  # fresh: at the head, state = newest checkpoint + tail
        with KvEventSubscriber(bridge.pub, bridge.replay) as sub:
            bootstrap_at(sub, now.offset)  # seq = offset - 1
            assert sub.view() == now.view() and len(now.view()[("gpu-engine", "GPU", 0)]) > 200
            publish(stream, at, 10)  # live on top of it
            assert sub.run_until(lambda s: s.next_seq == now.offset + 10)
            assert sub.view() == daemon_state(proc).view()
        bridge.stop()
        saved = int(admin.hget(keys.bridge("kv-bridge"), "offset") or 0) or now.offset + 10
        publish(stream, at + 10, 300)  # the bridge's position is trimmed meanwhile
        publish_until_trimmed(stream, admin, keys, at + 310, saved + 1)
        now = daemon_state(proc)
        bridge.start()  # resumes: its position is gone, it jumps to the newest checkpoint
        with KvEventSubscriber(bridge.pub, bridge.replay) as sub:
            bootstrap_at(sub, now.offset)
            assert sub.view() == now.view()
        assert "jumping to the checkpoint" in bridge.output()
    finally:
        bridge.stop()
        stream.close()
        proc.kill()
