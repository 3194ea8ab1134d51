"""Stored log records: the domain reading and the view the bridge publishes from."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from events.codec_vllm import encode_batch
from events.records import (
    BULK_FIELDS,
    ClearedView,
    RecordView,
    RemovedView,
    StoredView,
    decode_record,
    decode_record_view,
    encode_record,
)
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, LogRecord, SchemaError
from tests.events.event_strategies import event_lists, names


@pytest.mark.parametrize(
    ("view", "domain"),
    [
        (StoredView, BlockStored),
        (RemovedView, BlockRemoved),
        (ClearedView, AllBlocksCleared),
        (RecordView, LogRecord),
    ],
)
def test_views_are_the_schema_as_stored(view: Any, domain: Any) -> None:
    got = [(f.name, f.encode_name, f.default) for f in msgspec.structs.fields(view)]
    want = [(f.name, f.encode_name, f.default) for f in msgspec.structs.fields(domain)]
    assert got == want
    assert view.__struct_config__.tag == domain.__struct_config__.tag
    assert view.__struct_config__.tag_field == domain.__struct_config__.tag_field
    raw = {f.name for f in msgspec.structs.fields(view) if f.type is msgspec.Raw}
    assert raw == BULK_FIELDS & {f.name for f in msgspec.structs.fields(domain)}


@given(events=event_lists, ts=st.floats(0, 2e9), src=names, off=st.integers(1, 2**40))
def test_view_encodes_to_the_same_batch_as_the_record(
    events: list[Any], ts: float, src: str, off: int
) -> None:
    record = LogRecord(off, src, 3, 9, ts, tuple(events))
    view = decode_record_view(encode_record(record))
    assert (view.offset, view.source, view.incarnation, view.source_seq, view.ts) == (
        off, src, 3, 9, ts,
    )
    for layout in ("map", "legacy"):
        for source in (None, src):
            assert encode_batch(view.events, view.ts, layout=layout, source=source) == (
                encode_batch(record.events, record.ts, layout=layout, source=source)
            )


def test_view_leaves_value_checks_to_validation() -> None:
    # A medium outside the schema's is refused by the validating reader only; the view reads it.
    record = LogRecord(1, "e", 1, 1, 1.0, (BlockRemoved((1,), "DISK", 0),))  # type: ignore[arg-type]
    data = encode_record(record)
    with pytest.raises(SchemaError, match="medium"):
        decode_record(data)
    assert decode_record_view(data).events[0].medium == "DISK"


@pytest.mark.parametrize("data", [b"", b"\x01garbage", msgspec.msgpack.encode({"offset": 1})])
def test_unreadable_view_is_a_schema_error(data: bytes) -> None:
    with pytest.raises(SchemaError, match="log record"):
        decode_record_view(data)


def test_defaults_are_left_out_and_full_records_still_read() -> None:
    """A record leaves out fields at their defaults (DECISIONS 70); records written with every
    field (logs from before) read the same, both ways."""
    stored = BlockStored((7,), None, tuple(range(16)), 16, "GPU")
    removed = BlockRemoved((7,), "GPU")
    record = LogRecord(1, "e", 1, 1, 0.5, (stored, removed, AllBlocksCleared()))
    data = encode_record(record)
    full = msgspec.msgpack.encode({
        "offset": 1, "source": "e", "incarnation": 1, "source_seq": 1, "ts": 0.5, "events": [
            {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
             "token_ids": list(range(16)), "block_size": 16, "medium": "GPU", "group_idx": 0,
             "kv_cache_spec_kind": "full_attention", "sliding_window": None, "lora_name": None,
             "extra_keys": None, "provenance": None},
            {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0},
            {"type": "AllBlocksCleared", "medium": None}]})
    assert b"group_idx" not in data and b"kv_cache_spec_kind" not in data
    assert len(data) < len(full) - 90
    assert decode_record(full) == decode_record(data) == record
    assert decode_record_view(full) == decode_record_view(data)
    assert encode_batch(decode_record_view(full).events, 0.5) == encode_batch(record.events, 0.5)
