"""Redis: the single writer of the log and the projection, and the reads recovery needs.

Every change goes through :meth:`MetadataStore.append`: under one lock, one Lua script call
(``_WRITE``, one round trip) appends the records (entry ID ``{offset}-0``),
sets the head, the sources' fencing positions and the projection. The script first checks
everything that could make a command fail or make the write wrong: the head is the one we
expect, the namespace's owner lease is still ours (the fencing token, see offloadd.log.owner),
the stream's last ID is below our first offset (no foreign entry), every key has the type its
commands need. Only then does it write, so a write lands entirely or not at all (a MULTI/EXEC
whose XADD fails still applies its other commands). A refused write raises LogConflict naming
the cause. Memory changes only after the script succeeded (``apply``). When a call fails the
outcome is in doubt (it may have run); the next write, or the sweeper, resolves it by reading
the entry back: present -> ``apply``, absent -> ``revert``. Appends that share a call are
isolated: one whose record cannot be encoded or whose projection raises fails alone (and is
reverted), the rest are written; a write that fails as a whole reverts every append in it.

Reading the persisted state for recovery, a key of the wrong type, an undecodable value or a
log entry that is not a record raises ForeignData: one line naming it and the kvctl command
that inspects and repairs it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from events.logkeys import LogKeys
from events.records import RECORD_FIELD, decode_record, encode_record, entry_id
from events.schema import Event, LogRecord, SchemaError
from events.state import CacheState
from offloadd.errors import ForeignData, OffloaddError
from offloadd.log import projection
from offloadd.log.failover import end_rewound_log
from offloadd.log.projection import EngineRecord, LayoutRecord, Pipe, ProjectedBlock
from offloadd.log.replica_wait import WaitedScript
from rpc.redis_connect import client_url

log = logging.getLogger(__name__)

_record_decoder = msgspec.msgpack.Decoder(LogRecord)  # events.records' format, unvalidated


class RedisUnavailable(OffloaddError):
    """Redis could not be reached or refused the write; nothing was applied in memory."""


class LogConflict(OffloaddError):
    """The log moved under us (another writer, or a write we gave up on landed late)."""


class OwnershipLost(LogConflict):
    """The namespace's owner lease is no longer ours: another daemon may own it; stop."""


class ForeignEntry(LogConflict):
    """The log or a key the write needs holds what the daemon did not write; nothing written."""


@dataclass
class Append:
    """One record to append, with its projection updates and its in-memory effect."""

    source: str
    incarnation: int
    seq: int | Callable[[], int]  # a callable is evaluated under the writer lock
    events: tuple[Event, ...]
    project: Callable[[Pipe], None]
    apply: Callable[[LogRecord], None]
    revert: Callable[[], None] = lambda: None
    ts: float = field(default_factory=time.time)


@dataclass
class Persisted:
    """Everything recovery reads from Redis except the log itself."""

    head: int
    daemon: dict[str, str]
    sources: dict[str, tuple[int, int]]
    layouts: list[LayoutRecord]
    engines: list[EngineRecord]
    blocks: dict[int, dict[bytes, ProjectedBlock]]


class RecordRefused(OffloaddError):
    """One record of a write group could not be written (its projection raised): nothing of it
    was applied and its ``revert`` ran; the rest of the group was written without it."""


# KEYS: head, log, sources, owner, then the projection's keys.
# ARGV: expected head ('' = unchecked), owner value ('' = unchecked), number of records n,
#   new head; n x (entry id, record, source, position); ops: command, key index, nargs, args...
# Checks first, writes after: a check that fails returns {code, detail...} having written nothing.
_WRITE = """
local kinds = {}
local function kind(i)
  if kinds[i] == nil then kinds[i] = redis.call('TYPE', KEYS[i])['ok'] end
  return kinds[i]
end
local want = {'string', 'stream', 'hash', 'string'}
for i = 1, 4 do
  if kind(i) ~= 'none' and kind(i) ~= want[i] then return {'wrongtype', KEYS[i], kind(i), want[i]} end
end
if ARGV[2] ~= '' then
  local cur = redis.call('GET', KEYS[4])
  if cur ~= ARGV[2] then return {'owner', cur or ''} end
end
if ARGV[1] ~= '' then
  local raw = redis.call('GET', KEYS[1]) or '0'
  if not string.match(raw, '^%d+$') then return {'badhead', raw} end
  if tonumber(raw) ~= tonumber(ARGV[1]) then return {'head', raw} end
end
local n = tonumber(ARGV[3])
if n > 0 and kind(2) == 'stream' then
  local info = redis.call('XINFO', 'STREAM', KEYS[2])
  for j = 1, #info, 2 do
    if info[j] == 'last-generated-id' then
      local ms = tonumber(string.match(info[j + 1], '^(%d+)'))
      if ms >= tonumber(string.match(ARGV[5], '^(%d+)')) then return {'foreign', info[j + 1]} end
    end
  end
end
local op_kind = {HSET = 'hash', HDEL = 'hash', SADD = 'set', SREM = 'set'}
local first_op = 5 + 4 * n
local i = first_op
while i <= #ARGV do
  local k, w = tonumber(ARGV[i + 1]), op_kind[ARGV[i]]
  if ARGV[i] == 'DEL' then kinds[k] = 'none'
  elseif kind(k) ~= 'none' and kind(k) ~= w then return {'wrongtype', KEYS[k], kind(k), w}
  elseif ARGV[i] == 'HSET' or ARGV[i] == 'SADD' then kinds[k] = w end
  i = i + 3 + tonumber(ARGV[i + 2])
end
for r = 0, n - 1 do
  local b = 5 + 4 * r
  redis.call('XADD', KEYS[2], ARGV[b], 'r', ARGV[b + 1])
  redis.call('HSET', KEYS[3], ARGV[b + 2], ARGV[b + 3])
end
i = first_op
while i <= #ARGV do
  local nargs = tonumber(ARGV[i + 2])
  redis.call(ARGV[i], KEYS[tonumber(ARGV[i + 1])], unpack(ARGV, i + 3, i + 2 + nargs))
  i = i + 3 + nargs
end
if n > 0 then redis.call('SET', KEYS[1], ARGV[4]) end
return {'ok'}
"""
# KEYS: owner, log. ARGV: owner value ('' = unchecked), min entry id. A log that is not a
# stream is left alone (the next write names it).
_TRIM = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'owner'} end
if redis.call('TYPE', KEYS[2])['ok'] ~= 'stream' then return {'none'} end
return {'ok', redis.call('XTRIM', KEYS[2], 'MINID', ARGV[2])}
"""
# KEYS: owner, epoch. ARGV: owner value ('' = unchecked), new epoch, '1' = only if none is set.
# Returns {'owner'} refused, else {'ok', the epoch now}.
_SET_EPOCH = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'owner'} end
if ARGV[3] == '1' then redis.call('SET', KEYS[2], ARGV[2], 'NX') else redis.call('SET', KEYS[2], ARGV[2]) end
return {'ok', redis.call('GET', KEYS[2])}
"""
_OP_CHUNK = 512  # members per queued command: Lua's unpack() is bounded (~8000 values)
_FIXED_KEYS = 4


class _Ops:
    """A :class:`Pipe` that records projection commands as the script's flat op list."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self._index = {k: i + 1 for i, k in enumerate(keys)}  # Lua's KEYS count from 1
        self.args: list[Any] = []

    def _key(self, name: str) -> int:
        if name not in self._index:
            self.keys.append(name)
            self._index[name] = len(self.keys)
        return self._index[name]

    def _op(self, cmd: str, name: str, values: list[Any], step: int = 1) -> None:
        size = _OP_CHUNK * step
        for at in range(0, len(values), size):
            part = values[at:at + size]
            self.args.extend((cmd, self._key(name), len(part), *part))

    def hset(self, name: str, key: Any = None, value: Any = None, mapping: Any = None) -> None:
        pairs: list[Any] = [] if key is None else [key, value]
        for f, v in (mapping or {}).items():
            pairs += (f, v)
        self._op("HSET", name, pairs, 2)

    def hdel(self, name: str, *keys: Any) -> None:
        self._op("HDEL", name, list(keys))

    def sadd(self, name: str, *values: Any) -> None:
        self._op("SADD", name, list(values))

    def srem(self, name: str, *values: Any) -> None:
        self._op("SREM", name, list(values))

    def delete(self, *names: str) -> None:
        for name in names:
            self.args.extend(("DEL", self._key(name), 0))


_Pending = tuple[Append, "asyncio.Future[LogRecord]"]  # an append and its caller's answer
_Batch = list[tuple[LogRecord, bytes, Append]]  # records of one write, encoded
_GROUP_MAX = 64


class _ProjectFailed(Exception):
    """``item``'s project callback raised while its write was being built."""

    def __init__(self, item: Append) -> None:
        super().__init__(f"project callback of a {item.source} record raised")
        self.item = item


def _revert(item: Append) -> None:
    try:
        item.revert()
    except Exception:  # a bug in a revert callback must not stop the others'
        log.exception("revert failed")


def _fail(
    group: list[_Pending], exc: Exception, cause: BaseException | None = None,
    revert: bool = True,
) -> None:
    """Answer every unanswered append of ``group`` with ``exc``; with ``revert``, nothing of
    them is in the log, so each one's ``revert`` undoes what its caller did ahead of the write
    (reserved victims, a commit's flag). A write in doubt is reverted when resolved instead."""
    exc.__cause__ = cause
    for item, future in group:
        if future.done():
            continue
        future.set_exception(exc)
        if revert:
            _revert(item)


class MetadataStore:
    def __init__(self, client: aioredis.Redis, keys: LogKeys, state: CacheState) -> None:
        self.client: Any = client  # redis-py's stubs type replies as unions; we read bytes
        self.state = state
        self.keys = keys
        self.head = 0
        self._lock = asyncio.Lock()
        self._queue: list[_Pending] = []
        self._writer: asyncio.Task[None] | None = None
        self._in_doubt: _Batch | None = None
        self._appended = asyncio.Event()
        self._script: Any = client.register_script(_WRITE)
        self._trim = client.register_script(_TRIM)
        self._set_epoch = client.register_script(_SET_EPOCH)
        self.owner = ""  # the owner lease value every write is fenced by ('' = unchecked)
        # Takes the owner lease again when it ran out with nobody taking it (offloadd.log.owner)
        self.retake_owner: Callable[[], Awaitable[str]] | None = None

    def wait_for_replicas(self, replicas: int, timeout_ms: int) -> None:
        """Acknowledge appends only once ``replicas`` replicas have them (DECISIONS 40)."""
        self._script = WaitedScript(self.client, self._script, replicas, timeout_ms)

    @property
    def is_in_doubt(self) -> bool:
        return self._in_doubt is not None

    # -- writing --------------------------------------------------------------------------

    async def append(self, item: Append) -> LogRecord:
        """Append one non-empty record durably, then apply it in memory; or raise.

        Appends that arrive while a write is in flight are grouped into the next write
        (each still its own record and offset, applied in order), so concurrent engines and
        commits share Redis round trips instead of queueing for one each.
        """
        assert item.events, "never append an empty record"
        future: asyncio.Future[LogRecord] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._drain())
        return await asyncio.shield(future)  # a cancelled caller must not cancel the write

    async def _drain(self) -> None:
        while self._queue:
            group, self._queue = self._queue[:_GROUP_MAX], self._queue[_GROUP_MAX:]
            async with self._lock:
                try:
                    await self._write_group(group)
                except Exception as exc:  # a bug in the writer: never hang callers, undo theirs
                    log.exception("append failed")
                    _fail(group, exc, revert=self._in_doubt is None)

    async def _write_group(self, group: list[_Pending]) -> None:
        """Write ``group`` in one script call. An append that cannot be written (its record does
        not encode, its projection raises) fails alone and is reverted; the others are written."""
        try:
            await self._resolve_locked()
        except (RedisUnavailable, LogConflict) as exc:
            _fail(group, exc)
            return
        while True:
            group = [p for p in group if not p[1].done()]
            batch = self._records(group)
            group = [p for p in group if not p[1].done()]  # _records refuses what cannot encode
            if not batch:
                return
            try:
                await self._write(batch)
            except _ProjectFailed as exc:
                log.error("%s; writing the rest of its group without it", exc, exc_info=exc.__cause__)
                _fail([p for p in group if p[0] is exc.item],
                      RecordRefused(f"record not written: {exc.__cause__!r}"), exc.__cause__)
                continue
            except LogConflict as exc:  # refused by the script: nothing written
                _fail(group, exc)
                return
            except (RedisError, OSError) as exc:
                self._in_doubt = batch
                what = "refused the write" if isinstance(exc, ResponseError) else "unreachable"
                _fail(group, RedisUnavailable(f"Redis {what}, record not applied: {exc}"), exc,
                      revert=False)
                return
            break
        outcomes = self._commit_locked(batch)
        for (record, _, _), (_, future), error in zip(batch, group, outcomes, strict=True):
            if future.done():
                continue
            if error is None:
                future.set_result(record)
            else:
                future.set_exception(error)

    def _records(self, group: list[_Pending]) -> _Batch:
        """Number and encode ``group``'s records; one that cannot be encoded (a value msgpack
        cannot hold) is refused alone with a SchemaError and reverted, the others close up."""
        batch: _Batch = []
        last_seq: dict[str, int] = {}  # callable seqs: the 2nd record of a source in a group is +1
        for item, future in group:
            if callable(item.seq):
                prev = last_seq.get(item.source)
                seq = item.seq() if prev is None else prev + 1
            else:
                seq = item.seq
            record = LogRecord(self.head + 1 + len(batch), item.source, item.incarnation, seq,
                               item.ts, item.events)
            try:
                data = encode_record(record)
            except Exception as exc:  # msgspec: TypeError, OverflowError, EncodeError...
                log.error("record of %s seq %d cannot be logged: %r", item.source, seq, exc)
                _fail([(item, future)], SchemaError(
                    f"record of {item.source} (seq {seq}) cannot be logged: {exc}"), exc)
                continue
            last_seq[item.source] = seq
            batch.append((record, data, item))
        return batch

    async def _write(self, batch: _Batch) -> None:
        keys = self.keys
        ops = _Ops([keys.head, keys.log, keys.sources, keys.owner])
        records: list[Any] = []
        for record, data, item in batch:
            records += (entry_id(record.offset), data, record.source,
                        projection.encode((record.incarnation, record.source_seq)))
            try:
                item.project(ops)
            except Exception as exc:  # nothing was sent: the group is rebuilt without it
                raise _ProjectFailed(item) from exc
        await self._run(ops, [self.head, self.owner, len(batch), batch[-1][0].offset,
                              *records, *ops.args])

    async def refence(self) -> None:
        """Retake a lease that ran out, between two writes (the renewal's path)."""
        async with self._lock:
            if self.retake_owner is not None:
                self.owner = await self.retake_owner()

    async def _run(self, ops: _Ops, args: list[Any]) -> None:
        """Run the write script; a refusal (nothing written) raises LogConflict or ForeignData."""
        reply = await self._script(keys=ops.keys, args=args)
        code = reply[0].decode()
        if code == "owner" and not reply[1] and self.retake_owner is not None and args[1]:
            # The lease ran out while Redis was out of reach and nobody took it: retake, retry.
            self.owner = args[1] = await self.retake_owner()
            reply = await self._script(keys=ops.keys, args=args)
            code = reply[0].decode()
        if code == "ok":
            return
        detail = [d.decode(errors="replace") if isinstance(d, bytes) else str(d) for d in reply[1:]]
        k = self.keys
        if code == "head":
            if detail[0].isdigit() and int(detail[0]) < self.head:  # a failover lost records
                raise LogConflict(await end_rewound_log(self.client, k, self.owner, int(detail[0]), self.head))
            raise LogConflict(f"log head moved past {self.head} under the daemon (it is {detail[0]})")
        if code == "owner":
            now = f"token {detail[0].split(':', 1)[0]}" if detail[0] else "none"
            raise OwnershipLost(f"namespace {k.namespace!r} is no longer owned by this daemon "
                                f"(owner now: {now}); write refused")
        if code == "foreign":
            raise ForeignEntry(
                f"log {k.log} already holds entry ID {detail[0]}, at or past the next offset "
                f"{self.head + 1}: an entry the daemon did not write; {self.repair_hint()}")
        if code == "badhead":
            raise ForeignEntry(f"key {k.head} holds {detail[0]!r}, not an offset; {self.repair_hint()}")
        if code == "wrongtype":
            raise ForeignEntry(f"WRONGTYPE: key {detail[0]} is a {detail[1]}, expected a "
                               f"{detail[2]}; {self.repair_hint()}")
        raise LogConflict(f"write refused: {code} {detail}")

    async def drop_legacy_gpu_sets(self) -> int:
        """Delete the per-engine GPU-tier sets older daemons wrote (DECISIONS 33): nothing reads
        them any more. Returns how many were deleted."""
        deleted = 0
        try:
            async for key in self.client.scan_iter(match=self.keys.engine_blocks("*"), count=1000):
                deleted += await self.client.delete(key)
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(f"Redis unreachable: {exc}") from exc
        return deleted

    def repair_hint(self) -> str:
        """The kvctl commands that inspect and repair this namespace's keys."""
        url = client_url(self.client)
        ns = self.keys.namespace
        return (f"inspect with 'kvctl verify {url} --namespace {ns}', remove foreign data with "
                f"'kvctl repair {url} --namespace {ns} --drop-foreign'")

    def _commit_locked(self, batch: _Batch) -> list[Exception | None]:
        """Apply records the log now holds, in order; per record, what its apply raised."""
        outcomes: list[Exception | None] = []
        for record, _, item in batch:
            self.head = record.offset
            self.state.apply(record)  # the one reducer, over exactly what the log holds
            try:
                item.apply(record)
            except Exception as exc:  # logged already: not reverted, the others still applied
                log.exception("apply of logged record %d failed", record.offset)
                outcomes.append(exc)
            else:
                outcomes.append(None)
        self._appended.set()
        self._appended = asyncio.Event()
        return outcomes

    async def resolve(self) -> None:
        """Settle a write whose outcome is in doubt (called by the sweeper too)."""
        if self._in_doubt is None:
            return
        async with self._lock:
            await self._resolve_locked()

    async def _resolve_locked(self) -> None:
        """One write landed entirely or not at all: read its records back to know which."""
        if self._in_doubt is None:
            return
        batch = self._in_doubt
        first, last = batch[0][0].offset, batch[-1][0].offset
        try:
            found = await self.client.xrange(self.keys.log, entry_id(first), entry_id(last))
            head = int(await self.client.get(self.keys.head) or 0)
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(f"Redis unreachable: {exc}") from exc
        self._in_doubt = None
        ours = [data for _, data, _ in batch]
        if [fields.get(RECORD_FIELD) for _, fields in found] == ours and head == last:
            log.warning("write in doubt had landed; applying offsets %d..%d", first, last)
            self._commit_locked(batch)
        elif not found and head == self.head:
            for _, _, item in reversed(batch):
                _revert(item)  # one revert that raises must not leak the others' slots
        elif head < self.head:  # a failover lost acknowledged records too
            raise LogConflict(await end_rewound_log(self.client, self.keys, self.owner, head, self.head))
        else:
            raise LogConflict(f"log at offsets {first}..{last} is not what the daemon wrote "
                              f"(head {head})")

    async def write_registration(self, layouts: list[LayoutRecord], engine: EngineRecord | None) -> None:
        """Persist layouts (ids, chunk counts) and an engine registration; not a log record,
        but fenced by the owner lease like one."""
        ops = _Ops([self.keys.head, self.keys.log, self.keys.sources, self.keys.owner])
        for rec in layouts:
            ops.hset(self.keys.layouts, rec.identity, projection.encode(rec))
        if engine is not None:
            ops.hset(self.keys.engines, engine.engine_id, projection.encode(engine))
        await self._run_unlogged(ops, "registration not saved")

    async def _run_unlogged(self, ops: _Ops, what: str) -> None:
        try:
            await self._run(ops, ["", self.owner, 0, 0, *ops.args])
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(f"Redis unreachable, {what}: {exc}") from exc

    def next_append(self) -> asyncio.Event:
        """An event set at the next append: take it before reading, wait on it after."""
        return self._appended

    # -- reading --------------------------------------------------------------------------

    async def read_range(self, start: int, count: int, validate: bool = True) -> list[LogRecord]:
        """Records from offset ``start`` on. ``validate=False`` is for replays into the reducer,
        which validates every event itself (and records, rather than raises, what is wrong).
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
                record = decode_record(data) if validate else _record_decoder.decode(data)
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

    async def iter_log(self, page: int = 2000, start: int = 1) -> AsyncIterator[list[LogRecord]]:
        """The log from offset ``start`` on, page by page; the next page is fetched while the
        caller works."""
        nxt = asyncio.ensure_future(self.read_range(start, page, validate=False))
        while True:
            records = await nxt
            if not records:
                return
            nxt = asyncio.ensure_future(
                self.read_range(records[-1].offset + 1, page, validate=False)
            )
            try:
                yield records
            except BaseException:
                nxt.cancel()
                raise

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

    async def trim_log(self, min_offset: int) -> int:
        """Drop the records before ``min_offset`` (XTRIM MINID), fenced by the owner lease like
        every write; the caller never passes an offset past the oldest kept checkpoint + 1
        (offloadd.log.checkpoint). Returns how many records were dropped."""
        try:
            reply = await self._trim(keys=[self.keys.owner, self.keys.log],
                                     args=[self.owner, entry_id(min_offset)])
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(f"Redis unreachable, log not trimmed: {exc}") from exc
        code = reply[0].decode()
        if code == "owner":
            raise OwnershipLost(f"namespace {self.keys.namespace!r} is no longer owned by this "
                                f"daemon; log trim refused")
        return int(reply[1]) if code == "ok" else 0

    async def load(self) -> Persisted:
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
        blocks: dict[int, dict[bytes, ProjectedBlock]] = {}
        await self._check_types({k.blocks(rec.layout_id): "hash" for rec in layout_recs})
        try:
            for rec in layout_recs:
                rows: dict[bytes, ProjectedBlock] = {}
                cursor = 0
                while True:  # paged, so no single reply is large enough to hit the timeout
                    cursor, page = await self.client.hscan(k.blocks(rec.layout_id), cursor, count=20_000)
                    rows.update(self._decode_all(k.blocks(rec.layout_id), page,
                                                 projection.decode_block, text=False))
                    if cursor == 0:
                        break
                blocks[rec.layout_id] = rows
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
            blocks=blocks,
        )

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

    def _decode_all(
        self, key: str, rows: dict[bytes, bytes], decode: Callable[[bytes], Any], text: bool = True,
    ) -> dict[Any, Any]:
        """``{field: decode(value)}``, fields as str when ``text``; ForeignData names the
        first field that does not decode."""
        out: dict[Any, Any] = {}
        for f, v in rows.items():
            try:
                out[f.decode() if text else f] = decode(v)
            except (msgspec.DecodeError, UnicodeDecodeError, ValueError) as exc:
                raise ForeignData(f"field {f[:60]!r} of {key} does not decode ({exc}); "
                                  f"{self.repair_hint()}") from exc
        return out

    async def set_epoch(self, epoch: str, only_if_absent: bool) -> str:
        """Set the log's epoch (fenced by the owner lease like every write; with
        ``only_if_absent`` an epoch already there stays); the epoch now. OwnershipLost when the
        lease is not ours, RedisUnavailable when Redis cannot be reached."""
        try:
            reply = await self._set_epoch(keys=[self.keys.owner, self.keys.epoch],
                                          args=[self.owner, epoch, "1" if only_if_absent else "0"])
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(f"Redis unreachable setting the log epoch: {exc}") from exc
        if reply[0] != b"ok":
            raise OwnershipLost(f"namespace {self.keys.namespace!r} is no longer owned by this "
                                "daemon; the log epoch was not set")
        now = reply[1]
        return str(now.decode() if isinstance(now, bytes) else now)

    async def set_daemon_fields(self, fields: dict[str, str]) -> None:
        ops = _Ops([self.keys.head, self.keys.log, self.keys.sources, self.keys.owner])
        ops.hset(self.keys.daemon, mapping=fields)
        await self._run_unlogged(ops, "daemon fields not saved")
