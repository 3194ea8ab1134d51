"""IngestStream and gRPC's message size: an oversize batch is split (order, parents and seqs
kept), one block too big alone is left out and reported, and a daemon with a smaller limit than
the client's makes the client split further instead of resending the same batch forever."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kvcache.v1 import events_pb2, log_pb2, log_pb2_grpc

from events.codec_proto import EventBatch, batch_from_proto, batch_to_proto
from events.schema import BlockRemoved, BlockStored, Event, LogRecord
from events.state import CacheState
from offloadd.client import IngestStream, OffloadClient
from offloadd.client.batch_split import BatchTooLarge, event_budget, split_events
from tests.support.offloadd_proc import DaemonProcess

LIMIT = 64 << 10  # the small daemon's message limit in these tests
BLOCK = 16


def long_chain(n: int, start: int = 1, parent: int | None = None) -> BlockStored:
    """One BlockStored of ``n`` blocks, token ids that take 3 bytes each on the wire."""
    tokens = tuple(100_000 + i % 1000 for i in range(n * BLOCK))
    return BlockStored(tuple(range(start, start + n)), parent, tokens, BLOCK, "GPU")


@pytest.fixture
def small_daemon(tmp_path: Path, redis_url: str, namespace: str) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace,
                         extra_args=("--max-message-bytes", str(LIMIT)))
    proc.start()
    yield proc
    proc.kill()


def records(target: str) -> list[tuple[int, int, tuple[Event, ...]]]:
    with OffloadClient(target) as client:
        return [(r.incarnation, r.source_seq, r.events) for r in client.subscribe(1)]


def test_split_keeps_order_and_parents() -> None:
    big = long_chain(3000, parent=7)
    removed = BlockRemoved(tuple(range(1, 40_001)), "GPU")
    msg = batch_to_proto(EventBatch("e", 1, 1, 0.0, (big, removed)))
    budget = event_budget("e", LIMIT)
    split = split_events(list(msg.events), budget, 4096)
    assert not split.refused and len(split.batches) > 2
    events: list[Event] = []
    for part in split.batches:
        out = events_pb2.EventBatch(engine_id="e", incarnation=1, seq=1, ts=1.0, events=part)
        assert out.ByteSize() <= LIMIT
        events.extend(batch_from_proto(out).events)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert sum((e.block_hashes for e in stored), ()) == big.block_hashes
    assert sum((e.token_ids for e in stored), ()) == big.token_ids
    assert [e.parent_block_hash for e in stored] == [7, *(e.block_hashes[-1] for e in stored[:-1])]
    gone = [e for e in events if isinstance(e, BlockRemoved)]
    assert events.index(gone[0]) > events.index(stored[-1])  # order kept
    assert sum((e.block_hashes for e in gone), ()) == removed.block_hashes


def test_oversize_batch_is_split_into_consecutive_records(small_daemon: DaemonProcess) -> None:
    """Before the split this batch (~150 KB) was refused by the daemon's limit with
    RESOURCE_EXHAUSTED and resent on every reconnect, forever."""
    stream = IngestStream(small_daemon.target, "eng", 5, max_message_bytes=LIMIT,
                          backoff_s=(0.02, 0.2))
    try:
        events = (long_chain(3000, parent=None), long_chain(2, start=10_000, parent=3000))
        last = stream.submit(events)
        assert last > 2
        assert stream.flush(20), stream.last_error
        assert stream.num_reconnects == 0 and stream.num_oversize == 0
        state = CacheState()
        with OffloadClient(small_daemon.target) as client:
            got = list(client.subscribe(1))
        for record in got:
            state.apply(record)
    finally:
        stream.close()
    assert [(r.incarnation, r.source_seq) for r in got] == [(5, s) for s in range(1, last + 1)]
    whole = CacheState()  # what the batch unsplit would have made: the same blocks and parents
    whole.apply(LogRecord(1, "eng", 5, 1, 0.0, events))
    assert dict(state.blocks("eng", "GPU")) == dict(whole.blocks("eng", "GPU"))
    assert len(state.blocks("eng", "GPU")) == 3002


def test_a_client_above_the_daemon_limit_splits_instead_of_spinning(
    small_daemon: DaemonProcess,
) -> None:
    stream = IngestStream(small_daemon.target, "eng", 6, backoff_s=(0.02, 0.2))  # 4 MiB default
    try:
        stream.submit([long_chain(3000)])
        assert stream.flush(20), f"still unacked: {stream.num_pending}, {stream.last_error}"
        assert stream.max_message_bytes == LIMIT  # the daemon's, taken from its refusal
        assert stream.num_reconnects <= 2
        stream.submit([long_chain(3000, start=5000)])  # split at once now
        assert stream.flush(20), stream.last_error
        got = records(small_daemon.target)
    finally:
        stream.close()
    assert [seq for _, seq, _ in got] == list(range(1, len(got) + 1))
    assert sum(len(e.block_hashes) for _, _, evs in got for e in evs if isinstance(e, BlockStored)) == 6000


def test_one_block_too_big_is_left_out_and_reported(small_daemon: DaemonProcess) -> None:
    seen: list[BatchTooLarge] = []
    stream = IngestStream(small_daemon.target, "eng", 8, max_message_bytes=LIMIT,
                          on_oversize=seen.append)
    huge = BlockStored((99,), None, tuple(range(100_000, 130_000)), 30_000, "GPU")
    try:
        stream.submit([BlockStored((1,), None, (1, 2), 2, "GPU"), huge, BlockRemoved((1,), "GPU")])
        assert stream.flush(10), stream.last_error
        assert stream.num_oversize == 1 and len(seen) == 1
        assert "left out" in str(seen[0]) and "block_stored" in str(seen[0])
        assert stream.num_reconnects == 0 and stream.num_resets == 0
        got = records(small_daemon.target)
    finally:
        stream.close()
    assert len(got) == 1
    assert [type(e).__name__ for e in got[0][2]] == ["BlockStored", "BlockRemoved"]


def test_daemon_refuses_a_bad_message_limit(tmp_path: Path, redis_url: str) -> None:
    proc = DaemonProcess(tmp_path / "d", redis_url, "bad", extra_args=("--max-message-bytes", "0"))
    with pytest.raises(Exception, match="max_message_bytes"):
        proc.start(timeout_s=10)


def test_a_record_past_4_mib_reads_back(daemon: DaemonProcess) -> None:
    """The daemon accepts up to 64 MiB (a publisher other than IngestStream, or an older one);
    OffloadClient reads such a record back (gRPC's default 4 MiB would refuse it every time)."""
    size = 4096
    big = BlockStored(tuple(range(1, 401)), None, (100_000,) * (400 * size), size, "GPU")
    msg = batch_to_proto(EventBatch("raw", 1, 1, 1.0, (big,)))
    assert msg.ByteSize() > 4 << 20
    with grpc.insecure_channel(daemon.target) as ch:
        acks = list(log_pb2_grpc.EventIngestStub(ch).Publish(iter([msg]), timeout=30))
    assert [a.status for a in acks] == [log_pb2.PublishAck.STATUS_APPLIED]
    with OffloadClient(daemon.target) as client:
        got = list(client.subscribe(1))
    assert [len(e.block_hashes) for r in got for e in r.events if isinstance(e, BlockStored)] == [400]


def test_a_limit_too_small_to_carry_a_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="max_message_bytes: must be >= 4096"):
        IngestStream("127.0.0.1:1", "eng", 1, max_message_bytes=100)
