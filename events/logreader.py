"""Reads the durable log (a Redis stream, see events.records) by offset.

The caller builds the Redis client and passes it in, together with the exception types that
mean "Redis is unreachable right now" (``transient``): ``events`` imports no Redis package, so
the entry points (kv-bridge, kvctl) name those types. Such errors surface as
:class:`LogUnavailable`, which callers retry with backoff; anything else is a bug or bad data.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final, Protocol

from events.errors import EventsError
from events.logkeys import LogKeys
from events.records import RECORD_FIELD, decode_record, entry_id, offset_of
from events.schema import LogRecord, SchemaError

DEFAULT_CHUNK: Final[int] = 1000

RawEntry = tuple[int, bytes]
"""``(offset, stored bytes)`` of one log entry, not yet decoded."""


class LogUnavailable(EventsError):
    """Redis could not be reached; the operation may be retried."""


class StreamClient(Protocol):
    """The part of ``redis.Redis`` the reader uses (bytes responses, decode_responses=False)."""

    def get(self, name: str) -> Any: ...

    def xrange(self, name: str, min: str = "-", max: str = "+", count: int | None = None) -> Any: ...

    def xrevrange(self, name: str, max: str = "+", min: str = "-", count: int | None = None) -> Any: ...

    def xread(self, streams: Any, count: int | None = None, block: int | None = None) -> Any: ...

    def ping(self) -> Any: ...

    def pipeline(self, transaction: bool = True) -> Any: ...


class LogReader:
    """Range reads and blocking follow over one namespace's log."""

    def __init__(
        self,
        client: StreamClient,
        keys: LogKeys,
        transient: tuple[type[BaseException], ...] = (OSError,),
    ) -> None:
        self._client = client
        self._keys = keys
        self._transient = transient

    @property
    def keys(self) -> LogKeys:
        return self._keys

    def ping(self) -> None:
        self._call(self._client.ping)

    def head(self) -> int:
        """Offset of the last appended record (0 for an empty log).

        The daemon maintains ``LogKeys.head`` in the same transaction as the append; when that
        key is missing (a log written by another tool) the last stream entry decides.
        """
        raw = self._call(self._client.get, self._keys.head)
        if raw is not None:
            return int(raw)
        entries = self._call(self._client.xrevrange, self._keys.log, "+", "-", 1)
        return offset_of(entries[0][0]) if entries else 0

    def first_offset(self) -> int:
        """Offset of the oldest record still in the log (0 for an empty log)."""
        entries = self._call(self._client.xrange, self._keys.log, "-", "+", 1)
        return offset_of(entries[0][0]) if entries else 0

    def read_range_raw(
        self, start_offset: int, end_offset: int | None = None, count: int = DEFAULT_CHUNK
    ) -> list[RawEntry]:
        """Up to ``count`` entries with ``start_offset <= offset <= end_offset`` (None: no bound)."""
        start_offset = max(1, start_offset)
        if end_offset is not None and end_offset < start_offset:
            return []
        high = "+" if end_offset is None else entry_id(end_offset)
        entries = self._call(self._client.xrange, self._keys.log, entry_id(start_offset), high, count)
        return [_raw(entry_id_value, fields) for entry_id_value, fields in entries]

    def read_range_raw_and_get(
        self, start_offset: int, count: int, key: str, *, wait_after: int = 0, block_ms: int = 0
    ) -> tuple[list[RawEntry], bytes | None]:
        """Up to ``count`` entries from ``start_offset`` on, and the value of ``key`` read after
        them, in one round trip (a pipeline, which the server runs in order). ``block_ms`` > 0:
        first wait up to that long for an entry after offset ``wait_after`` (a blocking XREAD
        whose answer is dropped: the server runs the reads once it is over)."""
        pipe = self._client.pipeline(transaction=False)
        if block_ms > 0:
            pipe.xread({self._keys.log: f"{wait_after}-0"}, 1, block_ms)
        pipe.xrange(self._keys.log, entry_id(max(1, start_offset)), "+", count)
        pipe.get(key)
        *_, entries, value = self._call(pipe.execute)
        return [_raw(entry_id_value, fields) for entry_id_value, fields in entries], value

    def read_range(
        self, start_offset: int, end_offset: int | None = None, count: int = DEFAULT_CHUNK
    ) -> list[LogRecord]:
        """Decoded :meth:`read_range_raw`; SchemaError names a bad entry."""
        return [decode_entry(e) for e in self.read_range_raw(start_offset, end_offset, count)]

    def iter_range_raw(
        self, start_offset: int, end_offset: int | None = None, chunk: int = DEFAULT_CHUNK
    ) -> Iterator[RawEntry]:
        """Every entry in ``[start_offset, end_offset]``, read ``chunk`` entries at a time."""
        next_offset = max(1, start_offset)
        while end_offset is None or next_offset <= end_offset:
            entries = self.read_range_raw(next_offset, end_offset, chunk)
            if not entries:
                return
            yield from entries
            next_offset = entries[-1][0] + 1

    def iter_range(
        self, start_offset: int, end_offset: int | None = None, chunk: int = DEFAULT_CHUNK
    ) -> Iterator[LogRecord]:
        """Every record in ``[start_offset, end_offset]``, decoded."""
        for entry in self.iter_range_raw(start_offset, end_offset, chunk):
            yield decode_entry(entry)

    def iter_entries(self, chunk: int = DEFAULT_CHUNK) -> Iterator[tuple[bytes, dict[Any, Any]]]:
        """Every stream entry as stored, ``(entry ID, fields)``, foreign ones included: the head
        key does not bound it and IDs need not be ``{offset}-0`` (for verify and repair)."""
        start = "-"
        while True:
            entries = self._call(self._client.xrange, self._keys.log, start, "+", chunk)
            yield from entries
            if len(entries) < chunk:
                return
            last = entries[-1][0]
            start = "(" + (last.decode() if isinstance(last, bytes) else last)

    def poll_raw(self, after_offset: int, block_ms: int, count: int = DEFAULT_CHUNK) -> list[RawEntry]:
        """Entries with offset > ``after_offset``, waiting up to ``block_ms`` when there are none."""
        last_id = f"{after_offset}-0" if after_offset > 0 else "0-0"
        reply = self._call(
            self._client.xread, {self._keys.log: last_id}, count, block_ms if block_ms > 0 else None
        )
        if not reply:
            return []
        # redis-py answers XREAD as [[stream, entries]] (RESP2) or {stream: [entries]} (RESP3).
        streams = reply.items() if isinstance(reply, dict) else reply
        out: list[RawEntry] = []
        for _name, entries in streams:
            if entries and isinstance(entries[0], list) and isinstance(entries[0][0], list | tuple):
                entries = entries[0]  # RESP3 nests the entry list once more
            out.extend(_raw(entry_id_value, fields) for entry_id_value, fields in entries)
        return out

    def poll(self, after_offset: int, block_ms: int, count: int = DEFAULT_CHUNK) -> list[LogRecord]:
        """Decoded :meth:`poll_raw`."""
        return [decode_entry(e) for e in self.poll_raw(after_offset, block_ms, count)]

    def follow(self, from_offset: int, block_ms: int = 1000) -> Iterator[LogRecord]:
        """Records from ``from_offset`` on, forever (blocking reads; LogUnavailable propagates)."""
        after = max(0, from_offset - 1)
        while True:
            for record in self.poll(after, block_ms):
                yield record
                after = record.offset

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._transient as exc:
            raise LogUnavailable(f"redis unavailable: {exc}") from exc


def _raw(entry_id_value: bytes | str, fields: dict[Any, Any]) -> RawEntry:
    data = fields.get(RECORD_FIELD)
    if data is None:
        data = fields.get(RECORD_FIELD.decode())
    if isinstance(data, str):
        raise SchemaError("log reader needs a Redis client with decode_responses=False")
    # A missing field stays b"": decoding it fails with a message naming the entry.
    return offset_of(entry_id_value), data if data is not None else b""


def decode_stored(entry_id_value: bytes, fields: dict[Any, Any]) -> LogRecord:
    """One entry of :meth:`LogReader.iter_entries` as a record; SchemaError names the entry ID
    when it is not one (no record field, undecodable, or an ID other than ``{offset}-0``)."""
    name = entry_id_value.decode(errors="replace")
    offset, _, seq = name.partition("-")
    if not (offset.isdigit() and seq == "0" and int(offset) > 0):
        raise SchemaError(f"log entry {name}: not a record's entry ID (want OFFSET-0)")
    if RECORD_FIELD not in fields:
        raise SchemaError(f"log entry {name}: no field {RECORD_FIELD!r} (fields {sorted(fields)!r})")
    return decode_entry((int(offset), fields[RECORD_FIELD]))


def decode_entry(entry: RawEntry, *, validate: bool = True) -> LogRecord:
    """Decode and validate one stored entry; SchemaError names the offset and the problem.
    ``validate=False``: types only (events.records.decode_record)."""
    offset, data = entry
    if not data:
        raise SchemaError(f"log entry {offset}: no field {RECORD_FIELD!r}")
    try:
        record = decode_record(data, validate=validate)
    except SchemaError as exc:
        raise SchemaError(f"log entry {offset}: {exc}") from exc
    if record.offset != offset:
        raise SchemaError(f"log entry {offset} holds a record with offset {record.offset}")
    return record
