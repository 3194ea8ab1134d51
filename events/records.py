"""The durable log's storage format: one Redis stream entry per LogRecord.

The entry ID is ``f"{offset}-0"`` so a reader can range-scan by offset, and the entry holds
one field, ``r``: the record as msgpack (msgspec's encoding of :class:`LogRecord`). Writer
(offloadd.log.metadata) and readers (events.logreader, kvctl) both go through this module.
"""

from __future__ import annotations

from typing import Final

import msgspec

from events.schema import LogRecord, SchemaError, validate_event

RECORD_FIELD: Final[bytes] = b"r"

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LogRecord)


def encode_record(record: LogRecord) -> bytes:
    return _encoder.encode(record)


def decode_record(data: bytes) -> LogRecord:
    """Decode and validate one stored record; raise SchemaError naming what is wrong."""
    try:
        record = _decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError is a subclass
        raise SchemaError(f"log record: {exc}") from exc
    for event in record.events:
        validate_event(event)
    return record


def entry_id(offset: int) -> str:
    """The stream entry ID of the record at ``offset`` (offsets start at 1)."""
    if offset < 1:
        raise ValueError(f"log offsets start at 1, got {offset}")
    return f"{offset}-0"


def offset_of(entry_id_value: bytes | str) -> int:
    text = entry_id_value.decode() if isinstance(entry_id_value, bytes) else entry_id_value
    return int(text.split("-", 1)[0])
