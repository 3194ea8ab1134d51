"""Log records as JSON lines, for export, archives and inspection (one record per line).

Events keep their ``"type"`` tag. ``extra_keys`` must hold JSON values (strings, numbers, bools,
null, arrays); arrays come back as tuples. Bytes in ``extra_keys`` would come back as base64
text, so they do not round-trip through this format.

A file may start with one :class:`ArchiveHeader` line (``kvctl record --follow`` writes one per
archive file): the log's epoch, the offset of the file's first record and, for a file that
starts a trimmed log, the state before that record. :func:`load_file` returns it;
:func:`load_records` skips it. A header anywhere but the first line is an error.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import IO, Final

import msgspec

from events.codec_vllm import freeze_arrays
from events.schema import BlockStored, Event, LogRecord, SchemaError, validate_event
from events.state import Snapshot, SourceSnapshot

ARCHIVE_VERSION: Final[int] = 1


class ArchiveHeader(msgspec.Struct, frozen=True):
    """The first line of an archive file. ``kvoffload_archive`` (the format version) comes
    first, so a reader tells a header from a record by its first key."""

    kvoffload_archive: int
    namespace: str
    epoch: str | None  # the log's epoch (DESIGN 3.5); None for a log without one
    first_offset: int  # offset of the file's first record (the next one, while it has none)
    created_ts: float
    base: Snapshot | None = None  # the state at first_offset - 1, when the log before was trimmed


class _Probe(msgspec.Struct):
    kvoffload_archive: int | None = None


_ENCODER: Final = msgspec.json.Encoder()
_DECODER: Final = msgspec.json.Decoder(LogRecord)
_HEADER: Final = msgspec.json.Decoder(ArchiveHeader)
_PROBE: Final = msgspec.json.Decoder(_Probe)


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


def encode_header(header: ArchiveHeader) -> str:
    """The header as one JSON line, without the newline."""
    return _ENCODER.encode(header).decode()


def is_header(line: str | bytes) -> bool:
    """Whether the line is an archive header (a JSON object whose key is kvoffload_archive)."""
    try:
        return _PROBE.decode(line).kvoffload_archive is not None
    except msgspec.DecodeError:
        return False


def decode_header(line: str | bytes) -> ArchiveHeader:
    """Decode and check a header line; SchemaError names what is wrong."""
    try:
        header = _HEADER.decode(line)
    except msgspec.DecodeError as exc:
        raise SchemaError(f"archive header: {exc}") from exc
    if header.kvoffload_archive != ARCHIVE_VERSION:
        raise SchemaError(f"archive header: format version {header.kvoffload_archive}, this "
                          f"kvctl reads version {ARCHIVE_VERSION}")
    if header.first_offset < 1:
        raise SchemaError(f"archive header: first_offset {header.first_offset} (offsets start at 1)")
    base = header.base
    if base is not None:
        if base.offset != header.first_offset - 1:
            raise SchemaError(f"archive header: base at offset {base.offset}, want "
                              f"{header.first_offset - 1} (the offset before the first record)")
        sources = tuple(
            SourceSnapshot(s.source, s.incarnation, s.last_seq,
                           tuple(_fix_extra_keys(e) for e in s.events))  # type: ignore[misc]
            for s in base.sources
        )
        for s in sources:
            for event in s.events:
                validate_event(event)
        header = msgspec.structs.replace(header, base=Snapshot(base.offset, sources))
    return header


def dump_records(records: Iterable[LogRecord], fp: IO[str]) -> int:
    """Write one line per record; return how many were written."""
    n = 0
    for record in records:
        fp.write(encode_record(record))
        fp.write("\n")
        n += 1
    return n


def load_file(fp: Iterable[str | bytes]) -> tuple[ArchiveHeader | None, Iterator[LogRecord]]:
    """The file's header (None for a plain export) and its records, read lazily; blank lines
    are skipped; errors name the line number."""
    lines = enumerate(fp, start=1)
    for lineno, line in lines:
        if not line.strip():
            continue
        if is_header(line):
            try:
                return decode_header(line), _records(lines)
            except SchemaError as exc:
                raise SchemaError(f"line {lineno}: {exc}") from exc
        return None, _records(_chain((lineno, line), lines))
    return None, iter(())


def load_records(fp: Iterable[str | bytes]) -> Iterator[LogRecord]:
    """Read records line by line, skipping a leading archive header (:func:`load_file`)."""
    _header, records = load_file(fp)
    yield from records


def _chain(first: tuple[int, str | bytes], rest: Iterator[tuple[int, str | bytes]]
           ) -> Iterator[tuple[int, str | bytes]]:
    yield first
    yield from rest


def _records(lines: Iterator[tuple[int, str | bytes]]) -> Iterator[LogRecord]:
    for lineno, line in lines:
        if not line.strip():
            continue
        try:
            yield decode_record(line)
        except SchemaError as exc:
            why = ("an archive header after the first line (files concatenated?)"
                   if is_header(line) else str(exc))
            raise SchemaError(f"line {lineno}: {why}") from exc


def _fix_extra_keys(event: Event) -> Event:
    if isinstance(event, BlockStored) and event.extra_keys is not None:
        return msgspec.structs.replace(event, extra_keys=freeze_arrays(event.extra_keys))
    return event
