"""EventIngest fencing and the IngestStream transport, against a real daemon and real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
import redis.asyncio as aioredis
from kvcache.v1 import events_pb2, log_pb2, log_pb2_grpc

from events.codec_proto import EventBatch, batch_to_proto
from events.logkeys import LogKeys
from events.records import RECORD_FIELD, decode_record
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, Event
from events.state import CacheState
from offloadd.client import GroupQuery, IngestStream, OffloadClient, OffloadUnavailable, RetryPolicy
from offloadd.log.ingest import Ack, AckStatus, Ingest
from offloadd.log.metadata import MetadataStore, RecordRefused
from tests.offloadd.conftest import GROUP, chain, digest
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_proc import RedisProcess

ACK = log_pb2.PublishAck


def stored(h: int, parent: int | None = None) -> BlockStored:
    return BlockStored((h,), parent, (1, 2, 3, 4), 4, "GPU")


def batch(engine: str, inc: int, seq: int, *events: Event) -> events_pb2.EventBatch:
    return batch_to_proto(EventBatch(engine, inc, seq, time.time(), tuple(events)))


def publish(target: str, batches: list[events_pb2.EventBatch]) -> list[log_pb2.PublishAck]:
    with grpc.insecure_channel(target) as ch:
        return list(log_pb2_grpc.EventIngestStub(ch).Publish(iter(batches), timeout=10))


def replay(client: OffloadClient) -> CacheState:
    state = CacheState()
    for record in client.subscribe(1):
        state.apply(record)
    return state


def test_duplicate_gap_and_new_incarnation(daemon: DaemonProcess, client: OffloadClient) -> None:
    acks = publish(daemon.target, [
        batch("e", 5, 1, stored(10)),
        batch("e", 5, 2, stored(11, 10)),
        batch("e", 5, 2, stored(11, 10)),  # duplicate
        batch("e", 5, 4, stored(13)),      # gap
        batch("e", 4, 3, stored(99)),      # older incarnation
    ])
    assert [(a.status, a.acked_seq, a.resend_from) for a in acks] == [
        (ACK.STATUS_APPLIED, 1, 0), (ACK.STATUS_APPLIED, 2, 0), (ACK.STATUS_DUPLICATE, 2, 0),
        (ACK.STATUS_RESEND, 2, 3), (ACK.STATUS_REJECTED, 0, 0),
    ]
    assert "fenced out" in acks[4].message
    assert [a.log_offset for a in acks[:2]] == [1, 2]
    # a new incarnation must start at 1, and its first record clears the old GPU tier
    acks = publish(daemon.target, [batch("e", 6, 2, stored(20)), batch("e", 6, 1, stored(20))])
    assert [(a.status, a.resend_from) for a in acks] == [(ACK.STATUS_RESEND, 1), (ACK.STATUS_APPLIED, 0)]
    records = list(client.subscribe(1))
    assert len(records) == 3
    assert records[2].events == (AllBlocksCleared("GPU"), stored(20))
    assert (records[2].source, records[2].incarnation, records[2].source_seq) == ("e", 6, 1)
    state = replay(client)
    assert state.view() == {("e", "GPU", 0): frozenset({20})}
    assert state.violations == []
    assert client.snapshot().offset == 3


def test_rejected_batches_keep_the_stream_open(daemon: DaemonProcess, client: OffloadClient) -> None:
    acks = publish(daemon.target, [
        batch("e", 1, 1),  # empty
        batch("offloadd", 1, 1, stored(1)),  # the daemon's own source name
        batch("e", 0, 1, stored(1)),  # incarnation 0
        batch("e", 1, 1, stored(1)),
    ])
    assert [a.status for a in acks] == [ACK.STATUS_REJECTED] * 3 + [ACK.STATUS_APPLIED]
    assert "empty batch" in acks[0].message
    assert "reserved" in acks[1].message
    assert "incarnation must be > 0" in acks[2].message
    malformed = events_pb2.EventBatch(engine_id="e", incarnation=1, seq=2, events=[
        events_pb2.KvEvent(block_stored=events_pb2.BlockStored(block_hashes=[1], block_size=4,
                                                               token_ids=[1], medium=1))])
    (ack,) = publish(daemon.target, [malformed])
    assert ack.status == ACK.STATUS_REJECTED and "token_ids" in ack.message
    assert [r.offset for r in client.subscribe(1)] == [1]


def test_oversize_batch_rejected(tmp_path: Path, redis_url: str, namespace: str) -> None:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, extra_args=("--max-batch-events", "3"))
    proc.start()
    try:
        acks = publish(proc.target, [batch("e", 1, 1, *(stored(i) for i in range(4)))])
        assert acks[0].status == ACK.STATUS_REJECTED
        assert "4 events, the limit is 3" in acks[0].message
    finally:
        proc.kill()


@pytest.fixture
def stream(daemon: DaemonProcess) -> Iterator[IngestStream]:
    s = IngestStream(daemon.target, "eng", 100, backoff_s=(0.02, 0.2))
    yield s
    s.close()


def test_ingest_stream_acks_and_survives_daemon_restart(
    daemon: DaemonProcess, client: OffloadClient, stream: IngestStream
) -> None:
    for i in range(50):
        stream.submit([stored(i, i - 1 if i else None)])
    assert stream.flush(10)
    assert stream.acked_seq == 50 and stream.is_connected
    daemon.kill()
    for i in range(50, 60):  # generation goes on while the daemon is down
        stream.submit([stored(i, i - 1)])
    daemon.restart()
    assert stream.flush(15)
    assert stream.acked_seq == 60
    state = replay(client)
    assert state.view() == {("eng", "GPU", 0): frozenset(range(60))}
    assert state.fence("eng") == (100, 60)
    assert state.violations == []


def test_ingest_stream_resets_when_queue_full(daemon: DaemonProcess, client: OffloadClient) -> None:
    resets: list[int] = []
    s = IngestStream(daemon.target, "eng", 1, max_pending=4, on_reset=resets.append)
    try:
        daemon.kill()
        for i in range(6):
            s.submit([stored(i)])
        # After a reset nothing is sent until the engine re-announces what it holds (so the
        # batch that overflowed never becomes seq 1 of the new incarnation on its own).
        assert s.num_dropped == 6 and len(resets) == 1 and s.incarnation == resets[0] > 1
        s.resync([stored(4), stored(5)])
        daemon.restart()
        assert s.flush(15)
        state = replay(client)
        assert state.view() == {("eng", "GPU", 0): frozenset({4, 5})}
    finally:
        s.close()


def test_redis_outage_during_ingest(tmp_path: Path, own_redis: RedisProcess, namespace: str) -> None:
    proc = DaemonProcess(tmp_path / "d", own_redis.url, namespace)
    proc.start()
    s = IngestStream(proc.target, "eng", 1, backoff_s=(0.05, 0.3))
    try:
        with OffloadClient(proc.target, retry=RetryPolicy(attempts=2)) as c:
            c.register_engine("w", 1, "m", [GROUP])
            for i in range(20):
                s.submit([stored(i)])
            assert s.flush(10)
            own_redis.stop()
            for i in range(20, 40):
                s.submit([stored(i)])
            deadline = time.monotonic() + 10
            while "UNAVAILABLE" not in s.last_error and time.monotonic() < deadline:
                time.sleep(0.05)
            assert s.acked_seq == 20  # refused, not dropped: the engine keeps its batches
            assert "UNAVAILABLE" in s.last_error and "Redis" in s.last_error
            assert c.stats().log_offset == 20  # reads are served from memory
            assert c.lookup("w", [GroupQuery(0, (digest(0),))]).results[0].num_prefix == 0
            res = c.reserve("w", 0, chain(1))  # free slots: no Redis needed
            with pytest.raises(OffloadUnavailable) as err:
                c.commit("w", res.reservation_id)
            assert err.value.code.name == "UNAVAILABLE"
            assert "Redis unreachable" in err.value.message
            with pytest.raises(OffloadUnavailable):
                c.register_engine("x", 1, "m", [GROUP])
            own_redis.start()
            assert s.flush(20)
            state = replay(c)
            assert state.view() == {("eng", "GPU", 0): frozenset(range(40))}
            assert state.violations == []
            assert c.commit("w", res.reservation_id).num_committed == 1  # the retry succeeds
            assert c.lookup("w", [GroupQuery(0, (digest(0),))]).results[0].num_prefix == 1
            assert c.snapshot().offset == 41
    finally:
        s.close()
        proc.kill()


def test_removed_events_and_clear(daemon: DaemonProcess, client: OffloadClient) -> None:
    acks = publish(daemon.target, [
        batch("e", 1, 1, stored(1), stored(2, 1)),
        batch("e", 1, 2, BlockRemoved((2,), "GPU")),
        batch("e", 1, 3, AllBlocksCleared(None), stored(7)),
    ])
    assert [a.status for a in acks] == [ACK.STATUS_APPLIED] * 3
    assert replay(client).view() == {("e", "GPU", 0): frozenset({7})}


def _cleared(client: OffloadClient, engine_id: str, timeout_s: float = 10.0) -> None:
    """Until the log holds the daemon's clear of ``engine_id``'s tier (incarnation 0)."""
    deadline = time.monotonic() + timeout_s
    while not any(r.source == engine_id and r.incarnation == 0 for r in client.subscribe(1)):
        assert time.monotonic() < deadline, f"{engine_id} was never cleared"
        time.sleep(0.02)


@pytest.mark.parametrize("second_life", ["before-the-clear", "after-the-clear"])
def test_reused_incarnation_is_detected(
    daemon: DaemonProcess, client: OffloadClient, second_life: str,
) -> None:
    """A second life of engine "eng" under the same incarnation 7. Before the daemon cleared
    the first life's tier (its stream is still open), batch 1 is acked as a duplicate of seq 5:
    the reuse is certain. After the clear, the daemon asks to resend batch 1 itself (it takes
    no more of incarnation 7). Either way the stream starts a new incarnation, whose blocks
    are logged."""
    first = IngestStream(daemon.target, "eng", 7)
    for i in range(5):
        first.submit([stored(i)])
    assert first.flush(10)
    if second_life == "after-the-clear":
        first.close()  # departing: the next sweep clears eng's tier
        _cleared(client, "eng")
    again = IngestStream(daemon.target, "eng", 7)
    try:
        again.submit([stored(100)])
        assert again.flush(10)
        assert again.num_resets == 1 and again.incarnation > 7
        why = "incarnation reused" if second_life == "before-the-clear" else "resend batch 1 itself"
        assert why in again.last_error
        first.close()  # a no-op after the clear
        again.submit([stored(101)])
        assert again.flush(10)
        state = replay(client)
        assert state.view() == {("eng", "GPU", 0): frozenset({101})}
        assert state.fence("eng") == (again.incarnation, 1) and state.violations == []
    finally:
        again.close()
        first.close()


def test_a_pipelined_stream_is_acked_as_if_one_at_a_time(
    daemon: DaemonProcess, client: OffloadClient,
) -> None:
    """300 batches sent without waiting for acks, then a duplicate, a gap and a rejected batch:
    the acks are those of handling them one at a time, and the log holds the 300 in order."""
    batches = [batch("e", 1, seq, stored(seq)) for seq in range(1, 301)]
    acks = publish(daemon.target, [
        *batches, batch("e", 1, 150, stored(150)), batch("e", 1, 303, stored(303)),
        batch("e", 1, 301), batch("e", 1, 301, stored(301)),  # an empty batch is rejected
    ])
    assert [(a.status, a.acked_seq, a.log_offset) for a in acks[:300]] == [
        (ACK.STATUS_APPLIED, seq, seq) for seq in range(1, 301)
    ]
    assert [(a.status, a.acked_seq, a.resend_from) for a in acks[300:]] == [
        (ACK.STATUS_DUPLICATE, 300, 0), (ACK.STATUS_RESEND, 300, 301),
        (ACK.STATUS_REJECTED, 300, 0), (ACK.STATUS_APPLIED, 301, 0),
    ]
    assert replay(client).view() == {("e", "GPU", 0): frozenset(range(1, 302))}


def test_a_batch_after_one_that_failed_is_not_written(redis_url: str) -> None:
    """Batch 2's write fails while batch 3, fenced against it, waits in the next write: 3 must
    not be written (the log would skip seq 2); the engine's next batch 2 is fenced against the
    log again."""
    keys = LogKeys("chain")

    async def scenario() -> tuple[list[object], Ack, CacheState]:
        client = aioredis.Redis.from_url(redis_url)
        md = MetadataStore(client, keys, CacheState())
        ingest = Ingest(md, md.state, max_batch_events=16)
        await ingest.publish(EventBatch("e", 1, 1, 0.0, (stored(1),)))
        release = asyncio.Event()
        write = md._write

        async def broken(batch: object) -> None:
            md._write = write  # type: ignore[method-assign]  # only this write fails
            await release.wait()
            raise RuntimeError("writer bug")

        md._write = broken  # type: ignore[method-assign]
        second = await ingest.submit(EventBatch("e", 1, 2, 0.0, (stored(2),)))
        await asyncio.sleep(0.05)  # batch 2's write is in flight: batch 3 goes in the next one
        third = await ingest.submit(EventBatch("e", 1, 3, 0.0, (stored(3),)))
        release.set()
        outcomes = await asyncio.gather(second, third, return_exceptions=True)
        again = await ingest.publish(EventBatch("e", 1, 2, 0.0, (stored(2),)))
        await client.aclose()
        return list(outcomes), again, md.state

    outcomes, again, state = asyncio.run(scenario())
    assert isinstance(outcomes[0], RuntimeError)
    assert isinstance(outcomes[1], RecordRefused)
    assert (again.status, again.acked_seq, again.log_offset) == (AckStatus.APPLIED, 2, 2)
    assert state.fence("e") == (1, 2) and state.violations == []
    admin = redis.Redis.from_url(redis_url)
    stored_seqs = [decode_record(f[RECORD_FIELD]).source_seq for _, f in admin.xrange(keys.log)]
    admin.close()
    assert stored_seqs == [1, 2]
