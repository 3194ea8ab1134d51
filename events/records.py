"""The durable log's storage format: one Redis stream entry per LogRecord.

The entry ID is ``f"{offset}-0"`` so a reader can range-scan by offset, and the entry holds
one field, ``r``: the record as msgpack (msgspec's encoding of :class:`LogRecord`). Writer
(offloadd.log.metadata) and readers (events.logreader, kvctl, the bridge) all go through this
module, which reads a record two ways:

- :func:`decode_record`: the domain :class:`LogRecord`, validated;
- :func:`decode_record_view`: the same record with its bulk arrays (``BULK_FIELDS``) left as
  the msgpack bytes they were stored as (:class:`msgspec.Raw`), for a reader that only copies
  them on (the bridge's publish path: see events.codec_vllm.encode_batch). The view's types are
  derived from the schema's, so the two readings cannot drift apart;
- :func:`decode_record_packed`: the domain record, types checked, except that each
  ``BlockStored`` is an events.packed.PackedStored (its token ids left as stored): for a reader
  that publishes the record and applies it to a state (the bridge's publisher).
"""

from __future__ import annotations

import functools
import operator
import types
from typing import Any, Final, Literal, Union, get_args, get_origin

import msgspec

from events.packed import PackedStored
from events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    LogRecord,
    SchemaError,
    validate_event,
)

RECORD_FIELD: Final[bytes] = b"r"

BULK_FIELDS: Final[frozenset[str]] = frozenset({"block_hashes", "token_ids"})
"""Fields of stored events that a record view keeps as raw msgpack: most of a record's bytes.
(``extra_keys`` is decoded: mostly nil, and nil must read as None to stay off the wire.)"""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LogRecord)


def encode_record(record: LogRecord) -> bytes:
    return _encoder.encode(record)


def decode_record(data: bytes, *, validate: bool = True) -> LogRecord:
    """Decode and validate one stored record; raise SchemaError naming what is wrong.

    ``validate=False`` checks the types only: for a reader that applies the record to a
    ``CacheState``, which checks every event itself and records (rather than raises) what is
    wrong, as the daemon's recovery does (offloadd.log.log_reads).
    """
    try:
        record = _decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError is a subclass
        raise SchemaError(f"log record: {exc}") from exc
    if validate:
        for event in record.events:
            validate_event(event)
    return record


def _read_type(tp: Any) -> Any:
    """A view reads a Literal as its value type: the values are checked by validate_event where
    the record is applied, and one bad value must not make the rest of the record unreadable."""
    if get_origin(tp) is Literal:
        return type(get_args(tp)[0])
    if get_origin(tp) in (Union, types.UnionType):
        return functools.reduce(operator.or_, map(_read_type, get_args(tp)))
    return tp


def _view_of(cls: Any, replaced: dict[str, Any]) -> Any:
    """``cls`` as stored (same name, tag, field order and defaults) with some field types
    ``replaced``; every other field is read as :func:`_read_type` of its schema type."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(cls):
        tp = replaced.get(f.name, _read_type(f.type))
        fields.append((f.name, tp) if f.default is msgspec.NODEFAULT else (f.name, tp, f.default))
    config = cls.__struct_config__
    return msgspec.defstruct(
        cls.__name__ + "View",
        fields,
        tag=config.tag,
        tag_field=config.tag_field,
        array_like=config.array_like,
        frozen=True,
        module=__name__,
    )


_RAW: Final = dict.fromkeys(BULK_FIELDS, msgspec.Raw)

# Typed Any: they are built from the schema at import, so mypy cannot see their fields; they
# have the schema event's field names, with BULK_FIELDS as msgspec.Raw.
StoredView: Final[Any] = _view_of(BlockStored, _RAW)
RemovedView: Final[Any] = _view_of(BlockRemoved, _RAW)
ClearedView: Final[Any] = _view_of(AllBlocksCleared, _RAW)
RecordView: Final[Any] = _view_of(
    LogRecord, {"events": tuple[StoredView | RemovedView | ClearedView, ...]}
)
"""A LogRecord whose events are StoredView, RemovedView and ClearedView."""

EVENT_VIEWS: Final[tuple[type, ...]] = (StoredView, RemovedView, ClearedView)

_view_decoder = msgspec.msgpack.Decoder(RecordView)


def decode_record_view(data: bytes) -> Any:
    """One stored record as a :data:`RecordView`, not validated beyond its types; raise
    SchemaError when it cannot be read."""
    try:
        return _view_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise SchemaError(f"log record: {exc}") from exc


_PackedRecord: Final[Any] = msgspec.defstruct(
    "PackedRecord",
    [(f.name, tuple[PackedStored | BlockRemoved | AllBlocksCleared, ...])  # type: ignore[valid-type]
     if f.name == "events" else (f.name, f.type) for f in msgspec.structs.fields(LogRecord)],
    array_like=LogRecord.__struct_config__.array_like, frozen=True, module=__name__,
)
_packed_decoder = msgspec.msgpack.Decoder(_PackedRecord)


def decode_record_packed(data: bytes) -> LogRecord:
    """One stored record, types checked as ``decode_record(validate=False)`` checks them, with
    its ``BlockStored`` events as events.packed.PackedStored; SchemaError when it cannot be read."""
    try:
        r = _packed_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise SchemaError(f"log record: {exc}") from exc
    return LogRecord(r.offset, r.source, r.incarnation, r.source_seq, r.ts, r.events)


def entry_id(offset: int) -> str:
    """The stream entry ID of the record at ``offset`` (offsets start at 1)."""
    if offset < 1:
        raise ValueError(f"log offsets start at 1, got {offset}")
    return f"{offset}-0"


def offset_of(entry_id_value: bytes | str) -> int:
    text = entry_id_value.decode() if isinstance(entry_id_value, bytes) else entry_id_value
    return int(text.split("-", 1)[0])
