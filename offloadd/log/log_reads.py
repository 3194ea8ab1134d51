"""The reads of a namespace's log and projection: records for subscribers and replays, and
everything recovery reads (:class:`Persisted`).

A key of the wrong type, an undecodable value or a log entry that is not a record raises
ForeignData: one line naming it and the kvctl command that inspects and repairs it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import msgspec
from redis.exceptions import RedisError, ResponseError

from events.logkeys import LogKeys
from events.records import RECORD_FIELD, decode_record, decode_record_packed, entry_id
from events.schema import LogRecord, SchemaError
from offloadd.errors import ForeignData, OffloaddError
from offloadd.log import projection
from offloadd.log.log_errors import RedisUnavailable
from offloadd.log.projection import EngineRecord, LayoutRecord
from offloadd.tier.index import SlotEntry
from rpc.redis_connect import client_url

_FIRST_BYTE = itemgetter(slice(0, 1))


@dataclass
class Persisted:
    """Everything recovery reads from Redis except the log itself."""

    head: int
    daemon: dict[str, str]
    sources: dict[str, tuple[int, int]]
    layouts: list[LayoutRecord]
    engines: list[EngineRecord]
    blocks: dict[int, dict[bytes, SlotEntry]]  # layout -> its rows as entries (read_rows)
    num_rows: dict[int, int] = field(default_factory=dict)  # layout -> its projection's rows


class LogReads:
    """Reads of ``keys`` through ``client`` (the base of offloadd.log.metadata.MetadataStore)."""

    def __init__(self, client: Any, keys: LogKeys) -> None:
        self.client: Any = client  # redis-py's stubs type replies as unions; we read bytes
        self.keys = keys

    def repair_hint(self) -> str:
        """The kvctl commands that inspect and repair this namespace's keys."""
        url = client_url(self.client)
        ns = self.keys.namespace
        return (f"inspect with 'kvctl verify {url} --namespace {ns}', remove foreign data with "
                f"'kvctl repair {url} --namespace {ns} --drop-foreign'")

    async def read_range(self, start: int, count: int, validate: bool = True) -> list[LogRecord]:
        """Records from offset ``start`` on. ``validate=False`` is for replays into the reducer,
        which validates every event itself (and records, rather than raises, what is wrong):
        types only, token ids packed (events.packed), as the daemon's ingest holds them.
        An entry that is not one of our records (no field, undecodable, wrong ID) raises
        ForeignData naming it."""
        try:
            entries = await self.client.xrange(self.keys.log, entry_id(max(1, start)), "+", count=count)
        except (RedisError, OSError) as exc:
            raise self._read_error(exc, self.keys.log) from exc
        return [self._decode_entry(eid, fields, validate) for eid, fields in entries]

    def _decode_entry(self, eid: bytes, fields: dict[bytes, bytes], validate: bool) -> LogRecord:
        data = fields.get(RECORD_FIELD)
        name = eid.decode(errors="replace")
        if data is None:
            why = f"field {next(iter(fields), b'')!r}"
        else:
            try:
                record = decode_record(data) if validate else decode_record_packed(data)
            except (msgspec.DecodeError, SchemaError) as exc:
                why = f"undecodable: {exc}"
            else:
                if entry_id(record.offset) == name:
                    return record
                why = f"it holds offset {record.offset}"
        raise ForeignData(f"log entry {name} of {self.keys.log} is not a record ({why}); "
                          f"{self.repair_hint()}")

    def _read_error(self, exc: BaseException, key: str) -> OffloaddError:
        if isinstance(exc, ResponseError) and str(exc).startswith("WRONGTYPE"):
            return ForeignData(f"WRONGTYPE: key {key} holds a value of another type; "
                               f"{self.repair_hint()}")
        return RedisUnavailable(f"Redis unreachable: {exc}")

    def iter_log(self, page: int = 2000, start: int = 1,
                 pages_per_read: int = 16) -> AsyncIterator[list[LogRecord]]:
        """The log from offset ``start`` on, page by page. A record's entry ID is its offset, so
        the ID ranges of the pages to come are known before they are read: ``pages_per_read``
        of them are asked for in one pipeline (Redis answers them in one go on its own core, not
        queued behind a large read of the projection), the next batch while the caller works.
        The ranges ``[s, s + page)`` tile the IDs, so every entry in them is read and checked
        (ForeignData names one that is not a record); a page short of full (the end, or a gap)
        ends the tiling, and an open-ended read from its end finds what follows, wherever it is.

        The first pages are asked for when this is called (in a running event loop), ahead of
        any read started after it."""
        first = max(1, start)
        return self._pages(asyncio.ensure_future(self._read_tiles(first, page, pages_per_read)),
                           first, page, pages_per_read)

    async def _pages(self, pending: asyncio.Future[list[list[LogRecord]]], nxt: int, page: int,
                     pages_per_read: int) -> AsyncIterator[list[LogRecord]]:
        """:meth:`iter_log`'s pages, the first batch already asked for (``pending``)."""
        try:
            while True:
                pages = await pending
                short = next((i for i, got in enumerate(pages) if len(got) < page), None)
                if short is None:
                    nxt += page * len(pages)
                    pending = asyncio.ensure_future(self._read_tiles(nxt, page, pages_per_read))
                    for got in pages:
                        yield got
                    continue
                for got in pages[:short]:
                    yield got
                if pages[short]:
                    yield pages[short]
                more = await self.read_range(nxt + page * (short + 1), page, validate=False)
                if not more:
                    return
                nxt = more[-1].offset + 1
                pending = asyncio.ensure_future(self._read_tiles(nxt, page, pages_per_read))
                yield more
        finally:
            pending.cancel()  # a no-op once done; a caller that stopped early leaves one in flight

    async def _read_tiles(self, start: int, page: int, num_pages: int) -> list[list[LogRecord]]:
        """The pages ``[start + i * page, start + (i + 1) * page)`` for i < ``num_pages``, in one
        pipeline, unvalidated (:meth:`iter_log`). One entry more than a page can hold is asked
        for, so that an entry of another ID in the range is read (and refused) too."""
        log_key = self.keys.log
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for first in range(start, start + page * num_pages, page):
                    pipe.xrange(log_key, entry_id(first), "(" + entry_id(first + page), count=page + 1)
                replies = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise self._read_error(exc, log_key) from exc
        return [[self._decode_entry(eid, fields, False) for eid, fields in entries]
                for entries in replies]

    async def log_bounds(self) -> tuple[int, int]:
        """``(oldest retained offset, number of records)`` of the log; (0, 0) when empty."""
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.xrange(self.keys.log, "-", "+", count=1)
                pipe.xlen(self.keys.log)
                first, length = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise self._read_error(exc, self.keys.log) from exc
        return (int(first[0][0].split(b"-")[0]) if first else 0), int(length)

    async def load_meta(self) -> Persisted:
        """All of :class:`Persisted` but the projection's rows (``blocks`` left empty), with how
        many rows each layout has: small reads, made while the checkpoint loads."""
        k = self.keys
        await self._check_types({k.head: "string", k.daemon: "hash", k.sources: "hash",
                                 k.layouts: "hash", k.engines: "hash", k.log: "stream"})
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.get(k.head)
                pipe.hgetall(k.daemon)
                pipe.hgetall(k.sources)
                pipe.hgetall(k.layouts)
                pipe.hgetall(k.engines)
                head, daemon, sources, layouts, engines = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(f"Redis unreachable during recovery: {exc}") from exc
        layout_recs = list(self._decode_all(k.layouts, layouts, projection.decode_layout).values())
        block_keys = {rec.layout_id: k.blocks(rec.layout_id) for rec in layout_recs}
        await self._check_types({key: "hash" for key in block_keys.values()})
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for key in block_keys.values():
                    pipe.hlen(key)
                lengths = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(f"Redis unreachable during recovery: {exc}") from exc
        if head is not None and not head.isdigit():
            raise ForeignData(f"key {k.head} holds {head[:40]!r}, not an offset; {self.repair_hint()}")
        return Persisted(
            head=int(head or 0),
            daemon=self._decode_all(k.daemon, daemon, bytes.decode),
            sources=self._decode_all(k.sources, sources, projection.decode_position),
            layouts=layout_recs,
            engines=list(self._decode_all(k.engines, engines, projection.decode_engine).values()),
            blocks={},
            num_rows=dict(zip(block_keys, map(int, lengths), strict=True)),
        )

    async def load_rows(self, persisted: Persisted) -> dict[int, dict[bytes, SlotEntry]]:
        """The projection's rows of each layout :meth:`load_meta` found, as tier entries."""
        try:
            return {layout_id: await self.read_rows(self.keys.blocks(layout_id), num_rows)
                    for layout_id, num_rows in persisted.num_rows.items()}
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(f"Redis unreachable during recovery: {exc}") from exc

    async def read_rows(self, key: str, num_rows: int | None = None, page_rows: int = 20_000,
                        whole_rows: int = 250_000) -> dict[bytes, SlotEntry]:
        """A layout's projection rows, decoded as the tier entries they restore (READY, not yet
        verified: projection.decode_entry): in one HGETALL up to ``whole_rows`` of them (Redis
        makes the reply on its own core while the caller works: ~70 ms for 100k rows on the
        2-core machine, against ~95 ms as HSCAN pages, each asked for only once the last
        arrived); beyond, paged so that no reply is large enough to hit the timeout, the next
        page asked for before this one is decoded. ``num_rows``: HLEN, when the caller has it."""
        if (await self.client.hlen(key) if num_rows is None else num_rows) <= whole_rows:
            return self._decode_rows(key, await self.client.hgetall(key))
        rows: dict[bytes, SlotEntry] = {}
        nxt = asyncio.ensure_future(self.client.hscan(key, 0, count=page_rows))
        try:
            while True:
                cursor, page = await nxt
                if cursor != 0:
                    nxt = asyncio.ensure_future(self.client.hscan(key, cursor, count=page_rows))
                rows.update(self._decode_rows(key, page))
                if cursor == 0:
                    return rows
        finally:  # a page that failed to decode leaves the next one in flight
            if not nxt.done():
                nxt.cancel()
            elif not nxt.cancelled():
                nxt.exception()  # seen here: asyncio need not log it as never retrieved

    async def _check_types(self, want: dict[str, str]) -> None:
        """ForeignData naming the first key whose type is not the one we write there."""
        if not want:
            return
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for key in want:
                    pipe.type(key)
                kinds = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(f"Redis unreachable during recovery: {exc}") from exc
        for (key, expected), kind in zip(want.items(), kinds, strict=True):
            if kind.decode() not in ("none", expected):
                raise ForeignData(f"WRONGTYPE: key {key} is a {kind.decode()}, expected a "
                                  f"{expected}; {self.repair_hint()}")

    def _decode_rows(self, key: str, rows: dict[bytes, bytes]) -> dict[bytes, SlotEntry]:
        """:meth:`_decode_all` of projection rows as entries: each row's header checked for all
        of them at once, so that the rows are decoded in C when every one begins as an array of
        exactly the projection's fields; else each is checked as it is decoded."""
        clean = set(map(_FIRST_BYTE, rows.values())) <= {projection.ROW_HEADER}
        decode = projection.decode_entry_unchecked if clean else projection.decode_entry
        return self._decode_all(key, rows, decode, text=False)

    def _decode_all(
        self, key: str, rows: dict[bytes, bytes], decode: Callable[[bytes], Any], text: bool = True,
    ) -> dict[Any, Any]:
        """``{field: decode(value)}``, fields as str when ``text``; ForeignData names the
        first field that does not decode."""
        if not text:  # the common case in one C loop; the loop below names a bad field
            try:
                return dict(zip(rows, map(decode, rows.values()), strict=True))
            except (msgspec.DecodeError, UnicodeDecodeError, ValueError):
                pass
        out: dict[Any, Any] = {}
        for f, v in rows.items():
            try:
                out[f.decode() if text else f] = decode(v)
            except (msgspec.DecodeError, UnicodeDecodeError, ValueError) as exc:
                raise ForeignData(f"field {f[:60]!r} of {key} does not decode ({exc}); "
                                  f"{self.repair_hint()}") from exc
        return out
