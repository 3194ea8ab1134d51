"""events.packed: a BlockStored whose token ids stay the msgpack array they are stored as is the
same event to every reader: the same bytes in the log and on the wire, the same state, the same
snapshot; the ids are read where they are needed, and ids that do not read are an error there."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings

from events.codec_proto import record_from_proto, record_to_proto
from events.codec_vllm import encode_batch
from events.packed import PackedStored, count_ids, pack, packed, token_ids, unpacked
from events.records import decode_record, decode_record_packed, encode_record
from events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    LogRecord,
    SchemaError,
    validate_event,
)
from events.state import CacheState
from tests.events.event_strategies import block_stored, log_records


@settings(max_examples=200, deadline=None)
@given(block_stored())
def test_a_packed_event_encodes_and_reads_as_the_event(event: BlockStored) -> None:
    p = packed(event)
    assert type(p) is PackedStored and type(p.token_ids) is msgspec.Raw
    assert msgspec.msgpack.encode(p) == msgspec.msgpack.encode(event)
    assert token_ids(p) == event.token_ids and unpacked(p) == event
    assert count_ids(p.token_ids) == len(event.token_ids)
    assert encode_batch([p], 1.0, source="s") == encode_batch([event], 1.0, source="s")
    assert encode_batch([p], 1.0, layout="legacy") == encode_batch([event], 1.0, layout="legacy")


@settings(max_examples=200, deadline=None)
@given(log_records)
def test_a_record_read_packed_is_the_record(record: LogRecord) -> None:
    data = encode_record(record)
    read = decode_record_packed(data)
    assert type(read) is LogRecord and encode_record(read) == data
    assert not any(type(e) is BlockStored for e in read.events)
    plain = decode_record(data)
    assert tuple(unpacked(e) if type(e) is PackedStored else e for e in read.events) == plain.events
    # Through protobuf (the daemon's ReadLog and Snapshot answers): the ids as ints again.
    assert record_from_proto(record_to_proto(read)) == record_from_proto(record_to_proto(plain))


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 65_535, 65_536, 70_000])
def test_the_count_is_read_from_every_array_header(n: int) -> None:
    assert count_ids(pack(list(range(n)))) == n


@pytest.mark.parametrize("raw", [b"", b"\x01", b"\xa3abc", b"\xdc\x00", b"\xdd\x00\x00", b"\xc0"])
def test_what_is_not_an_array_has_no_count(raw: bytes) -> None:
    assert count_ids(msgspec.Raw(raw)) == -1


def _history() -> list[LogRecord]:
    """Chained stores of several blocks, stores again, removals, a clear, two sources."""
    def stored(hashes: tuple[int, ...], parent: int | None, medium: str = "GPU") -> BlockStored:
        ids = tuple(range(1000 * hashes[0], 1000 * hashes[0] + 4 * len(hashes)))
        return BlockStored(hashes, parent, ids, 4, medium)  # type: ignore[arg-type]

    evs: list[tuple[str, tuple[object, ...]]] = [
        ("a", (stored((1, 2, 3), None), stored((4,), 3))),
        ("b", (stored((10, 11), None), stored((10, 11), None, "CPU"))),
        ("a", (stored((5, 6), 4), BlockRemoved((2,), "GPU"), stored((2,), 1))),
        ("b", (AllBlocksCleared("GPU"), stored((12,), None))),
        ("a", (stored((7,), 6), BlockRemoved((7, 6), "GPU"), stored((20, 21, 22), None, "CPU"))),
    ]
    seqs: dict[str, int] = {}
    out = []
    for offset, (source, events) in enumerate(evs, 1):
        seqs[source] = seqs.get(source, 0) + 1
        out.append(LogRecord(offset, source, 1, seqs[source], 1.0, events))  # type: ignore[arg-type]
    return out


def test_a_state_of_packed_records_is_the_state_of_the_records() -> None:
    plain, packed_state = CacheState(), CacheState()
    for record in _history():
        data = encode_record(record)
        plain.apply(decode_record(data))
        packed_state.apply(decode_record_packed(data))
    assert packed_state == plain and packed_state.export() == plain.export()
    assert not plain.violations and not packed_state.violations
    # Every resident block's entry reads its ids from the packed event.
    for source, medium, group, _tier in plain.tiers():
        assert dict(packed_state.blocks(source, medium, group)) == dict(plain.blocks(source, medium, group))
    assert any(type(e) is PackedStored
               for _s, _m, _g, tier in packed_state.tiers() for e in tier.values())


def test_a_packed_event_with_the_wrong_count_is_the_same_violation() -> None:
    bad = BlockStored((1, 2), None, (1, 2, 3), 2, "GPU")  # 3 ids for 2 blocks of 2
    plain, packed_state = CacheState(), CacheState()
    plain.apply(LogRecord(1, "a", 1, 1, 1.0, (bad,)))
    packed_state.apply(LogRecord(1, "a", 1, 1, 1.0, (packed(bad),)))
    assert [v.kind for v in packed_state.violations] == ["invalid_event"]
    assert packed_state.violations == plain.violations
    assert packed_state.counts() == plain.counts() == {}


def test_ids_that_do_not_read_are_an_error_where_they_are_read() -> None:
    """The reducer counts packed ids from their header; ids that are not integers (no daemon
    writes them) surface as a SchemaError naming the field when a snapshot reads them."""
    junk = PackedStored((1,), None, msgspec.Raw(msgspec.msgpack.encode(["x", "y"])), 2, "GPU")  # type: ignore[arg-type]
    state = CacheState()
    state.apply(LogRecord(1, "a", 1, 1, 1.0, (junk,)))
    assert state.counts() == {("a", "GPU", 0): 1}
    with pytest.raises(SchemaError, match=r"BlockStored\.token_ids: not an array of integers"):
        state.export()
    with pytest.raises(SchemaError, match="token_ids"):
        unpacked(junk)


def test_a_packed_event_is_not_passed_as_another_event() -> None:
    """validate_event takes the schema's classes only: a packed event is unpacked first (the
    reducer's general path does), never read as a clear."""
    with pytest.raises(SchemaError, match="not an event: PackedStored"):
        validate_event(packed(BlockStored((1,), None, (1,), 1, "GPU")))  # type: ignore[arg-type]
    with pytest.raises(SchemaError, match="not an event"):
        validate_event(object())  # type: ignore[arg-type]

