"""A log that went back under the same epoch (bridge.tip): what a failover to a replica that had
not synced does to the log a bridge reads (tests/cluster/test_sentinel.py forces one).

The new primary holds the records up to some offset as the bridge read them, other records at
the offsets after it, and more than the bridge read; the epoch key is the same. Here one
transaction replaces the log with such a history, on a real Redis."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import redis

from bridge.tip import TipReader
from events.codec_vllm import WireBatch
from events.logkeys import LogKeys
from events.logreader import LogReader
from events.records import RECORD_FIELD, encode_record, entry_id
from events.schema import AllBlocksCleared, BlockRemoved, Event, LogRecord
from events.subscriber import KvEventSubscriber
from offloadd.client import IngestStream
from tests.bridge.test_bridge import _full_state
from tests.bridge.test_epoch import _stored
from tests.bridge.test_trimmed_log import (
    CKPT_ARGS,
    bootstrap_at,
    daemon_state,
    publish,
    publish_until_trimmed,
)
from tests.support.bridge_proc import BridgeProcess, LogWriter
from tests.support.offloadd_proc import DaemonProcess


def _record(offset: int, source: str, events: Sequence[Event]) -> LogRecord:
    return LogRecord(offset, source, 1, offset, time.time(), tuple(events))


def _rewrite(client: redis.Redis, keys: LogKeys, keep: int, after: Sequence[LogRecord]) -> None:
    """In one transaction: the log holds its records up to ``keep`` (the same bytes), then
    ``after``; the epoch key stays."""
    kept = client.xrange(keys.log, "-", entry_id(keep))
    pipe = client.pipeline(transaction=True)
    pipe.delete(keys.log)
    for eid, fields in kept:
        pipe.xadd(keys.log, fields, id=eid)
    for r in after:
        pipe.xadd(keys.log, {RECORD_FIELD: encode_record(r)}, id=entry_id(r.offset))
    pipe.set(keys.head, after[-1].offset if after else keep)
    pipe.execute()


def test_tip_reader_tells_a_rewound_log_from_a_continued_or_trimmed_one(client: redis.Redis) -> None:
    keys = LogKeys("tip" + uuid.uuid4().hex[:8])
    writer = LogWriter(client, keys.namespace)
    old = [writer.append("e0", [_stored(100 + i)], source_seq=i + 1) for i in range(5)]
    pub3, pub5 = encode_record(old[2]), encode_record(old[4])
    tip = TipReader(LogReader(client, keys), chunk=2)

    assert [o for o, _ in tip.read(3, None, 0).entries] == [4, 5]  # unchecked, a chunk of 2
    read = tip.read(5, pub5, 0)
    assert read.entries == [] and not read.rewound  # the published record, nothing after it

    # While the read waits, the log is replaced: the same 1..3, another 4 and 5, and a 6.
    other = [_record(4, "e1", [_stored(204)]), _record(5, "e1", [_stored(205)]),
             _record(6, "e1", [_stored(206)])]
    timer = threading.Timer(0.3, _rewrite, (client, keys, 3, other))
    timer.start()
    try:
        assert tip.read(5, pub5, 5000).rewound  # woken by 6, read with the check
    finally:
        timer.join()
    read = tip.read(3, pub3, 0)
    assert not read.rewound and [o for o, _ in read.entries] == [4, 5]
    _rewrite(client, keys, 4, [])
    assert tip.read(5, pub5, 0).rewound  # the log ends before the position

    _rewrite(client, keys, 3, old[3:])  # the published history again, one more, trimmed past 4
    LogWriter(client, keys.namespace).append("e0", [_stored(106)], source_seq=6)
    client.xtrim(keys.log, minid=entry_id(5), approximate=False)
    read = tip.read(3, pub3, 0)  # its record was trimmed: a gap, the caller's
    assert not read.rewound and [o for o, _ in read.entries] == [5, 6]
    assert [o for o, _ in tip.read(5, pub5, 0).entries] == [6]


def test_bridge_publishes_a_rewound_log_again_after_clearing(
    client: redis.Redis, redis_url: str, tmp_path: Path,
) -> None:
    ns = "rw" + uuid.uuid4().hex[:8]
    keys = LogKeys(ns)
    client.set(keys.epoch, "same")
    writer = LogWriter(client, ns)
    for i in range(5):
        writer.append(f"e{i % 2}", [_stored(100 + i)], source_seq=i // 2 + 1)
    bridge = BridgeProcess(redis_url, tmp_path / "b", "--start", "beginning", namespace=ns)
    bridge.start()
    sub = KvEventSubscriber(bridge.pub, bridge.replay, idle_sync_s=0.3, replay_timeout_s=2.0)
    seen: list[tuple[int, WireBatch]] = []
    sub.on_batch(lambda seq, batch: seen.append((seq, batch)))
    try:
        sub.replay_from(0)  # not published yet (healthy before the first read): live or caught up
        assert sub.run_until(lambda s: s.next_seq == 5, 10), sub.next_seq
        assert [s for s, _ in seen] == [0, 1, 2, 3, 4]

        # The new primary: records 1..3 as published, then another 4 and 5, and a 6.
        after = [_record(4, "e1", [_stored(204)]),
                 _record(5, "e0", [BlockRemoved((100,), "GPU"), _stored(205)]),
                 _record(6, "e0", [_stored(206)])]
        _rewrite(client, keys, 3, after)
        new_log = LogReader(client, keys).read_range(1)
        want = _full_state(new_log)
        assert sub.run_until(lambda s: s.state.view() == want.view(), 10), (
            sub.state.view(), bridge.output()[-2000:])
        assert sub.run_until(lambda s: s.next_seq == 13, 5), sub.next_seq
        assert [s for s, _ in seen] == list(range(13)) and sub.stats.lost == 0
        clears = [(b.sources, b.events) for _, b in seen[5:7]]
        assert clears == [(("e0",), (AllBlocksCleared(),)), (("e1",), (AllBlocksCleared(),))]
        assert [b.events for _, b in seen[7:]] == [r.events for r in new_log]
        assert "is not the record published there" in bridge.output()
        assert "kvbridge_log_rewinds_total 1.0" in bridge.metrics()
        assert sub.run_until(lambda s: bridge.health()[0] == 200, 5), bridge.health()

        with KvEventSubscriber(bridge.pub, bridge.replay) as fresh:  # by snapshot
            assert fresh.bootstrap() == 13
            assert fresh.view() == want.view()
        writer = LogWriter(client, ns)  # live on from the new log
        writer.append("e1", [_stored(207)], source_seq=9)
        assert sub.run_until(lambda s: s.next_seq == 14, 5), sub.next_seq
        assert seen[-1][1].events == (_stored(207),)
    finally:
        sub.close()
        bridge.stop()


def test_a_rewound_trimmed_log_is_published_again_from_its_checkpoint(
    client: redis.Redis, redis_url: str, tmp_path: Path,
) -> None:
    """The daemon trimmed the log behind its checkpoints; records after the newest checkpoint
    are replaced under the bridge: it publishes the clears, then the retained log (a gap: its
    state is the checkpoint's once it reaches its offset) and ends with the new log's state."""
    ns = "rwt" + uuid.uuid4().hex[:8]
    keys = LogKeys(ns)
    proc = DaemonProcess(tmp_path / "d", redis_url, ns, extra_args=CKPT_ARGS)
    proc.start()
    bridge = BridgeProcess(redis_url, tmp_path / "b", "--start", "beginning", namespace=ns)
    bridge.start()
    stream = IngestStream(proc.target, "gpu-engine", 3)
    try:
        publish(stream, 0, 200)
        publish_until_trimmed(stream, client, keys, 200, 50)
        daemon = daemon_state(proc).view()
        proc.kill()  # no more checkpoints (those in Redis are at or before the head), and the
        stream.close()  # stream's end is not logged (it would clear its source)
        writer = LogWriter(client, ns)
        head = writer.offset
        for i in range(1, 6):
            writer.append("x", [_stored(9000 + i)], source_seq=i)
        with KvEventSubscriber(bridge.pub, bridge.replay) as sub:
            bootstrap_at(sub, head + 5)  # published through it (seq = offset - 1)

        _rewrite(client, keys, head + 2, [_record(head + i, "x", [_stored(9100 + i)]) for i in range(3, 7)])
        want = {k: v for k, v in daemon.items() if v}
        want[("x", "GPU", 0)] = frozenset({9001, 9002, 9103, 9104, 9105, 9106})
        with KvEventSubscriber(bridge.pub, bridge.replay) as sub:
            deadline = time.monotonic() + 15
            while sub.bootstrap() is not None and {k: v for k, v in sub.view().items() if v} != want:
                assert time.monotonic() < deadline, (sub.view().get(("x", "GPU", 0)), bridge.output()[-3000:])
                time.sleep(0.1)
        out = bridge.output()
        assert "is not the record published there" in out and "after the gap" in out
    finally:
        bridge.stop()
        stream.close()
        proc.kill()
