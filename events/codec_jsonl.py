"""Log records as JSON lines, for export and inspection (one record per line).

Events keep their ``"type"`` tag. ``extra_keys`` must hold JSON values (strings, numbers, bools,
null, arrays); arrays come back as tuples. Bytes in ``extra_keys`` would come back as base64
text, so they do not round-trip through this format.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import IO, Final

import msgspec

from events.codec_vllm import freeze_arrays
from events.schema import BlockStored, Event, LogRecord, SchemaError, validate_event

_ENCODER: Final = msgspec.json.Encoder()
_DECODER: Final = msgspec.json.Decoder(LogRecord)


def encode_record(record: LogRecord) -> str:
    """One record as one JSON line, without the newline."""
    return _ENCODER.encode(record).decode()


def decode_record(line: str | bytes) -> LogRecord:
    """Decode and validate one line; raise SchemaError naming what is wrong."""
    try:
        record = _DECODER.decode(line)
    except msgspec.DecodeError as exc:
        raise SchemaError(str(exc)) from exc
    events = tuple(_fix_extra_keys(e) for e in record.events)
    for event in events:
        validate_event(event)
    return msgspec.structs.replace(record, events=events)


def dump_records(records: Iterable[LogRecord], fp: IO[str]) -> int:
    """Write one line per record; return how many were written."""
    n = 0
    for record in records:
        fp.write(encode_record(record))
        fp.write("\n")
        n += 1
    return n


def load_records(fp: Iterable[str | bytes]) -> Iterator[LogRecord]:
    """Read records line by line; blank lines are skipped; errors name the line number."""
    for lineno, line in enumerate(fp, start=1):
        if not line.strip():
            continue
        try:
            yield decode_record(line)
        except SchemaError as exc:
            raise SchemaError(f"line {lineno}: {exc}") from exc


def _fix_extra_keys(event: Event) -> Event:
    if isinstance(event, BlockStored) and event.extra_keys is not None:
        return msgspec.structs.replace(event, extra_keys=freeze_arrays(event.extra_keys))
    return event
