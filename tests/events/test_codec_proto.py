"""The protobuf codec: round trips and field-named errors on bad messages."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvcache.v1 import events_pb2, log_pb2

from events.codec_proto import (
    EventBatch,
    batch_from_proto,
    batch_to_proto,
    event_from_proto,
    event_to_proto,
    record_from_proto,
    record_to_proto,
    snapshot_from_proto,
    snapshot_to_proto,
)
from events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    LogRecord,
    SchemaError,
    validate_event,
)
from events.state import CacheState, Snapshot, SourceSnapshot
from tests.events.event_strategies import block_stored, event_lists, events, log_records, names


@given(events)
def test_event_round_trip_through_bytes(event: object) -> None:
    wire = event_to_proto(event).SerializeToString()  # type: ignore[arg-type]
    assert event_from_proto(events_pb2.KvEvent.FromString(wire)) == event


@given(log_records)
def test_record_round_trip(record: LogRecord) -> None:
    wire = record_to_proto(record).SerializeToString()
    assert record_from_proto(events_pb2.LogRecord.FromString(wire)) == record


@given(names.filter(bool), st.integers(1, 2**40), st.integers(1, 2**40), event_lists)
def test_batch_round_trip(engine: str, inc: int, seq: int, evs: list[object]) -> None:
    batch = EventBatch(engine, inc, seq, 12.5, tuple(evs))  # type: ignore[arg-type]
    wire = batch_to_proto(batch).SerializeToString()
    assert batch_from_proto(events_pb2.EventBatch.FromString(wire)) == batch


@given(st.lists(block_stored(), max_size=4))
def test_snapshot_round_trip(stored: list[BlockStored]) -> None:
    snap = Snapshot(9, (SourceSnapshot("e1", 2, 5, tuple(stored)), SourceSnapshot("d", 0, 0, ())))
    wire = snapshot_to_proto(snap).SerializeToString()
    assert snapshot_from_proto(log_pb2.SnapshotResponse.FromString(wire)) == snap


def test_state_export_survives_proto() -> None:
    state = CacheState()
    ev = BlockStored((1, 2), None, (1, 2, 3, 4), 2, "CPU", extra_keys=(("ad", 1), None))
    state.apply(LogRecord(1, "d", 3, 1, 0.0, (ev,)))
    back = snapshot_from_proto(snapshot_to_proto(state.export()))
    assert CacheState.from_snapshot(back) == state
    assert back.sources[0].events == (ev,)


def test_enums_and_optionals_on_the_wire() -> None:
    ev = BlockStored((5,), None, (1,), 1, "GPU", 1, "sliding_window", 64, "ad", (("x", 1),))
    msg = event_to_proto(ev).block_stored
    assert msg.medium == events_pb2.MEDIUM_GPU
    assert msg.kv_cache_spec_kind == events_pb2.KV_CACHE_SPEC_KIND_SLIDING_WINDOW
    assert not msg.HasField("parent_block_hash") and msg.sliding_window == 64
    assert list(msg.extra_keys) == [b"\x82\x61x\x01"]  # canonical CBOR ["x", 1]
    cleared = event_to_proto(AllBlocksCleared()).all_blocks_cleared
    assert cleared.medium == events_pb2.MEDIUM_UNSPECIFIED
    # UNSPECIFIED spec kind means full attention; empty extra_keys means None.
    plain = events_pb2.BlockStored(
        block_hashes=[1], token_ids=[7], block_size=1, medium=events_pb2.MEDIUM_CPU
    )
    got = event_from_proto(events_pb2.KvEvent(block_stored=plain))
    assert got == BlockStored((1,), None, (7,), 1, "CPU")


def _stored_msg(**over: object) -> events_pb2.KvEvent:
    fields: dict[str, object] = dict(
        block_hashes=[1], token_ids=[7], block_size=1, medium=events_pb2.MEDIUM_GPU
    )
    fields.update(over)
    return events_pb2.KvEvent(block_stored=events_pb2.BlockStored(**fields))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("msg", "message"),
    [
        (_stored_msg(medium=0), "BlockStored.medium: required"),
        (_stored_msg(medium=9), "BlockStored.medium: unknown value 9"),
        (_stored_msg(kv_cache_spec_kind=7), "BlockStored.kv_cache_spec_kind: unknown value 7"),
        (_stored_msg(block_hashes=[]), "BlockStored.block_hashes: must not be empty"),
        (_stored_msg(block_size=0), "BlockStored.block_size: must be > 0, got 0"),
        (
            _stored_msg(token_ids=[1, 2]),
            "BlockStored.token_ids: expected 1 ids (1 blocks x 1), got 2",
        ),
        (_stored_msg(extra_keys=[b"\xff"]), "BlockStored.extra_keys: bad CBOR"),
        (
            _stored_msg(extra_keys=[b"\xf6", b"\xf6"]),
            "BlockStored.extra_keys: need one entry per block hash",
        ),
        (
            events_pb2.KvEvent(block_removed=events_pb2.BlockRemoved(block_hashes=[1])),
            "BlockRemoved.medium: required",
        ),
        (
            events_pb2.KvEvent(all_blocks_cleared=events_pb2.AllBlocksCleared(medium=5)),
            "AllBlocksCleared.medium: unknown value 5",
        ),
        (events_pb2.KvEvent(), "KvEvent.event: required"),
    ],
)
def test_bad_messages_name_the_field(msg: events_pb2.KvEvent, message: str) -> None:
    with pytest.raises(SchemaError) as err:
        event_from_proto(msg)
    assert str(err.value).startswith(message)


def test_bad_envelopes() -> None:
    with pytest.raises(SchemaError, match=r"^EventBatch.engine_id: required$"):
        batch_from_proto(events_pb2.EventBatch(incarnation=1, seq=1))
    with pytest.raises(SchemaError, match=r"^LogRecord.offset: must be >= 1$"):
        record_from_proto(events_pb2.LogRecord(source="e"))
    removed = event_to_proto(BlockRemoved((1,), "GPU"))
    bad_snap = log_pb2.SnapshotResponse(sources=[log_pb2.SourceSnapshot(events=[removed])])
    with pytest.raises(SchemaError, match="only BlockStored allowed, got BlockRemoved"):
        snapshot_from_proto(bad_snap)


def test_values_that_do_not_fit_proto_fields_are_schema_errors() -> None:
    with pytest.raises(SchemaError, match=r"^BlockRemoved: Value out of range: -1$"):
        event_to_proto(BlockRemoved((1,), "GPU", -1))
    with pytest.raises(SchemaError, match=r"^BlockStored: Value out of range: 4294967296$"):
        event_to_proto(BlockStored((1,), None, (2**32,), 1, "GPU"))


_cbor_keys = st.sampled_from([b"\xf6", b"\x81\x01", b"\xff", b"\xc1\x01", b"\x81\xa0"])


@given(
    st.lists(st.integers(0, 2**64 - 1), max_size=3), st.lists(st.integers(0, 2**32 - 1), max_size=6),
    st.integers(0, 3), st.integers(0, 3), st.integers(0, 3), st.integers(0, 2**32 - 1),
    st.none() | st.integers(0, 2**64 - 1), st.none() | st.lists(_cbor_keys, max_size=3),
)
def test_decoder_accepts_exactly_what_validate_event_accepts(
    block_hashes: list[int], token_ids: list[int], block_size: int, medium: int, kind: int,
    group: int, parent: int | None, extra: list[bytes] | None,
) -> None:
    """The decoder skips the checks the proto types make; what it returns still validates, and
    what it refuses is refused with a SchemaError (never another error)."""
    msg = events_pb2.BlockStored(block_hashes=block_hashes, token_ids=token_ids,
                                 block_size=block_size, medium=medium, kv_cache_spec_kind=kind,
                                 group_idx=group, extra_keys=extra or [])
    if parent is not None:
        msg.parent_block_hash = parent
    try:
        event = event_from_proto(events_pb2.KvEvent(block_stored=msg))
    except SchemaError:
        return
    validate_event(event)
    assert event_from_proto(event_to_proto(event)) == event
