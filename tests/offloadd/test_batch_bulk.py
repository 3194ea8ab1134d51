"""offloadd.edge.batch_bulk reads a Publish batch exactly as events.codec_proto does with its
token ids packed: the same events, or the same SchemaError, for the batches it reads in bulk and
for those it hands back."""

from __future__ import annotations

import struct
from typing import Any

import grpc
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcache.v1 import events_pb2, log_pb2, log_pb2_grpc

from events.codec_proto import EventBatch, batch_from_proto, batch_to_proto
from events.logkeys import LogKeys
from events.logreader import LogReader
from events.packed import packed
from events.schema import BlockRemoved, BlockStored, Event, SchemaError
from offloadd.edge.batch_bulk import BULK_MIN_EVENTS, batch_from_wire, stored_events
from tests.events.event_strategies import events, hashes, media, tokens
from tests.support.offloadd_proc import DaemonProcess


@st.composite
def plain_stored(draw: st.DrawFn, group: int) -> BlockStored:
    """A BlockStored as engines send them: no extra keys, LoRA or window."""
    n = draw(st.integers(1, 3))
    size = draw(st.integers(1, 3))
    return BlockStored(tuple(draw(st.lists(hashes, min_size=n, max_size=n))),
                       draw(st.none() | hashes),
                       tuple(draw(st.lists(tokens, min_size=n * size, max_size=n * size))),
                       size, draw(media), group)


plain_batches = st.integers(0, 2).flatmap(  # one group per batch (mixed ones are handed back)
    lambda g: st.lists(plain_stored(g), min_size=BULK_MIN_EVENTS, max_size=30))
removals = st.builds(BlockRemoved, st.lists(hashes, min_size=1, max_size=3).map(tuple), media)
evicting_batches = st.integers(0, 2).flatmap(  # stores and removals interleaved (one group)
    lambda g: st.lists(plain_stored(g) | removals, min_size=BULK_MIN_EVENTS, max_size=30))


def _wire(evs: tuple[Event, ...], engine_id: str = "e") -> tuple[bytes, events_pb2.EventBatch]:
    raw = batch_to_proto(EventBatch(engine_id, 3, 7, 1.5, evs)).SerializeToString()
    return raw, events_pb2.EventBatch.FromString(raw)


def _packed(evs: tuple[Event, ...]) -> tuple[Event, ...]:
    """``evs`` as the daemon reads them: every BlockStored with its token ids packed."""
    return tuple(packed(e) if type(e) is BlockStored else e for e in evs)


def _same(raw: bytes, msg: events_pb2.EventBatch) -> EventBatch | None:
    """Both readings; the batch, or None when both raised the same SchemaError."""
    try:
        want = batch_from_proto(msg, packed=True)
    except SchemaError as exc:
        with pytest.raises(SchemaError) as got:
            batch_from_wire(raw, msg)
        assert str(got.value) == str(exc)
        return None
    assert batch_from_wire(raw, msg) == want
    return want


@settings(max_examples=150, deadline=None)
@given(plain_batches)
def test_plain_batches_read_in_bulk_as_the_decoder_reads_them(evs: list[BlockStored]) -> None:
    raw, msg = _wire(tuple(evs))
    assert stored_events(raw, len(evs)) == _packed(tuple(evs))  # in bulk, parents mixed or not
    assert _same(raw, msg) == EventBatch("e", 3, 7, 1.5, _packed(tuple(evs)))


@settings(max_examples=150, deadline=None)
@given(evicting_batches)
def test_stores_and_removals_read_in_bulk_in_their_order(evs: list[Event]) -> None:
    raw, msg = _wire(tuple(evs))
    assert stored_events(raw, len(evs)) == _packed(tuple(evs))
    assert _same(raw, msg) == EventBatch("e", 3, 7, 1.5, _packed(tuple(evs)))


@settings(max_examples=150, deadline=None)
@given(st.lists(events, min_size=BULK_MIN_EVENTS, max_size=12))
def test_any_batch_reads_as_the_decoder_reads_it(evs: list[Event]) -> None:
    _same(*_wire(tuple(evs)))  # removals, clears, extra keys, LoRA, windows: handed back


def _plain(n: int = 10) -> list[BlockStored]:
    return [BlockStored((i + 1,), i or None, (i, 200_000 + i), 2, "GPU") for i in range(n)]


@pytest.mark.parametrize("break_it", [
    lambda m: m.token_ids.append(5),  # one id too many in one event only
    lambda m: setattr(m, "block_size", 0),
    lambda m: setattr(m, "medium", events_pb2.MEDIUM_UNSPECIFIED),
    lambda m: setattr(m, "medium", 9),
    lambda m: setattr(m, "kv_cache_spec_kind", 7),
    lambda m: m.ClearField("block_hashes"),
    lambda m: m.ClearField("token_ids"),
    lambda m: m.extra_keys.append(b"\xff"),  # bad CBOR
])
def test_a_bad_event_is_refused_with_the_decoders_message(break_it: Any) -> None:
    _, msg = _wire(tuple(_plain()))
    break_it(msg.events[4].block_stored)
    raw = msg.SerializeToString()
    assert _same(raw, events_pb2.EventBatch.FromString(raw)) is None


@pytest.mark.parametrize("break_it", [
    lambda m: setattr(m, "medium", events_pb2.MEDIUM_UNSPECIFIED),
    lambda m: setattr(m, "medium", 9),
    lambda m: m.ClearField("block_hashes"),  # an empty removal is valid: read one by one
])
def test_a_removal_beside_stores_reads_as_the_decoder_reads_it(break_it: Any) -> None:
    evs: list[Event] = [*_plain(), BlockRemoved((5, 6), "GPU", 1), *_plain(3)]
    _, msg = _wire(tuple(evs))
    break_it(msg.events[10].block_removed)
    raw = msg.SerializeToString()
    _same(raw, events_pb2.EventBatch.FromString(raw))


def test_empty_engine_id_is_refused_as_before() -> None:
    assert _same(*_wire(tuple(_plain()), engine_id="")) is None


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    return bytes((*out, v))


def _len(number: int, payload: bytes) -> bytes:
    return _field(number, 2, _varint(len(payload)) + payload)


def _event(stored_fields: list[bytes]) -> bytes:
    return _len(5, _len(1, b"".join(stored_fields)))


@pytest.mark.parametrize("layout", ["unpacked hashes", "reversed fields", "split token run",
                                    "a parent after the tokens"])
def test_other_encodings_read_as_the_decoder_reads_them(layout: str) -> None:
    """Valid protobuf no encoder of ours writes: fields out of order, runs split or unpacked."""
    out = [_len(1, b"e")]
    for i in range(BULK_MIN_EVENTS + 2):
        h = _len(1, struct.pack("<Q", i + 1))
        ids = [i, 300 + i]
        t = _len(3, b"".join(_varint(x) for x in ids))
        rest = [_field(4, 0, _varint(2)), _field(5, 0, _varint(events_pb2.MEDIUM_GPU))]
        parent = [_field(2, 1, struct.pack("<Q", 99))] if i % 2 else []
        if layout == "unpacked hashes" and i == 3:
            h = _field(1, 1, struct.pack("<Q", i + 1))
        if layout == "split token run" and i == 3:
            t = _len(3, _varint(ids[0])) + _len(3, _varint(ids[1]))
        fields = [h, *parent, t, *rest]
        if layout == "reversed fields" and i == 3:
            fields.reverse()
        if layout == "a parent after the tokens" and i == 3:
            fields = [h, t, _field(2, 1, struct.pack("<Q", 7)), *rest]
        out.append(_event(fields))
    raw = b"".join(out)
    batch = _same(raw, events_pb2.EventBatch.FromString(raw))
    assert batch is not None and len(batch.events) == BULK_MIN_EVENTS + 2


@pytest.mark.parametrize("pair", ["a store and a removal", "two stores"])
def test_two_messages_in_one_event_beside_an_empty_one_read_as_the_decoder_reads_them(pair: str) -> None:
    """Protobuf merges an event's two messages into one (a oneof keeps the last) and leaves the
    empty event empty, which the decoder refuses; the columns would line up with two events."""
    stored = [_len(1, struct.pack("<Q", 5)), _len(3, _varint(1) + _varint(2)),
              _field(4, 0, _varint(2)), _field(5, 0, _varint(events_pb2.MEDIUM_GPU))]
    plain = [_event([_len(1, struct.pack("<Q", i + 10)), _len(3, _varint(i) + _varint(i + 1)),
                     _field(4, 0, _varint(2)), _field(5, 0, _varint(events_pb2.MEDIUM_GPU))])
             for i in range(BULK_MIN_EVENTS)]
    second = (_len(2, _len(1, struct.pack("<Q", 6)) + _field(2, 0, _varint(events_pb2.MEDIUM_GPU)))
              if pair == "a store and a removal" else _len(1, b"".join(stored)))
    crafted = _len(5, _len(1, b"".join(stored)) + second)
    raw = b"".join([_len(1, b"e"), *plain, crafted, _len(5, b"")])
    msg = events_pb2.EventBatch.FromString(raw)
    assert len(msg.events) == BULK_MIN_EVENTS + 2
    assert stored_events(raw, len(msg.events)) is None
    assert _same(raw, msg) is None  # refused, with the decoder's message


def test_small_batches_are_read_one_by_one() -> None:
    raw, msg = _wire(tuple(_plain(BULK_MIN_EVENTS - 1)))
    assert _same(raw, msg) == batch_from_proto(msg, packed=True)


def test_a_daemon_logs_bulk_batches_and_refuses_a_bad_one(daemon: DaemonProcess) -> None:
    """Through a real daemon and Redis: a bad event in a batch read in bulk is refused with
    the decoder's message; good batches are logged with exactly their events."""
    good = [tuple(BlockStored((100 * b + i + 1,), None, (i, 150_000 + i), 2, "GPU")
                  for i in range(100)) for b in range(2)]
    bad = batch_to_proto(EventBatch("bulk-engine", 1, 2, 0.0, good[1]))
    bad.events[7].block_stored.token_ids.append(3)
    msgs = [batch_to_proto(EventBatch("bulk-engine", 1, 1, 0.0, good[0])), bad,
            batch_to_proto(EventBatch("bulk-engine", 1, 2, 0.0, good[1]))]
    with grpc.insecure_channel(daemon.target) as ch:
        acks = list(log_pb2_grpc.EventIngestStub(ch).Publish(iter(msgs), timeout=20))
    assert [a.status for a in acks] == [log_pb2.PublishAck.STATUS_APPLIED,
                                        log_pb2.PublishAck.STATUS_REJECTED,
                                        log_pb2.PublishAck.STATUS_APPLIED]
    assert acks[1].message == ("malformed batch: BlockStored.token_ids: expected 2 ids "
                               "(1 blocks x 2), got 3")
    client = redis.Redis.from_url(daemon.redis_url)
    try:
        records = LogReader(client, LogKeys(daemon.namespace)).read_range(1)
    finally:
        client.close()
    assert [r.events for r in records if r.source == "bulk-engine"] == good
