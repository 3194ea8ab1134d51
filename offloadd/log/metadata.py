"""Redis: the single writer of the log and the projection.

Every change goes through :meth:`MetadataStore.append`: under one lock, one Lua script call
(offloadd.log.write_script, one round trip) appends the records (entry ID ``{offset}-0``), sets
the head, the sources' fencing positions and the projection, after checks that make a refused
write land nothing; a refused write raises LogConflict naming the cause. Memory changes only
after the script succeeded (``apply``). When a call fails the outcome is in doubt (it may have
run); the next write, the sweeper, or a fence that must read the log (offloadd.log.ingest)
resolves it by reading the entry back: present -> ``apply``, absent -> ``revert``. Appends that
share a call are isolated: one whose record cannot be encoded, whose projection raises, or whose
source position the log already holds (AlreadyLogged) fails alone (and is reverted), the rest
are written; a write that fails as a whole reverts every append in it.

The reads (records, and what recovery reads) are offloadd.log.log_reads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from events.logkeys import LogKeys
from events.records import entry_id
from events.schema import LogRecord
from events.state import CacheState
from offloadd.log import projection
from offloadd.log.append import Append, Batch, Pending, ProjectFailed, encode_group, fail, revert
from offloadd.log.failover import end_rewound_log
from offloadd.log.in_doubt import Confirm, read_back
from offloadd.log.log_errors import (
    AlreadyLogged,
    ForeignEntry,
    LogConflict,
    OwnershipLost,
    RecordRefused,
    RedisUnavailable,
    WriteInDoubt,
)
from offloadd.log.log_reads import LogReads, Persisted
from offloadd.log.projection import EngineRecord, LayoutRecord
from offloadd.log.replica_wait import ReplicasBehind, WaitedScript
from offloadd.log.write_script import SET_EPOCH, TRIM, WRITE, Ops, refusal

__all__ = [
    "AlreadyLogged", "Append", "ForeignEntry", "LogConflict", "MetadataStore", "OwnershipLost",
    "Persisted", "RecordRefused", "RedisUnavailable", "WriteInDoubt",
]

log = logging.getLogger(__name__)

_GROUP_MAX = 64


class MetadataStore(LogReads):
    """The namespace's single writer (module docstring) and its reads (LogReads)."""

    def __init__(self, client: aioredis.Redis, keys: LogKeys, state: CacheState) -> None:
        super().__init__(client, keys)
        self.state = state
        self.head = 0
        self._lock = asyncio.Lock()
        self._queue: list[Pending] = []
        self._writer: asyncio.Task[None] | None = None
        self._in_doubt: Batch | None = None
        self._appended = asyncio.Event()
        self._script: Any = client.register_script(WRITE)
        self._confirm: Confirm | None = None  # the replicas' word on a write in doubt
        self._trim = client.register_script(TRIM)
        self._set_epoch = client.register_script(SET_EPOCH)
        self.owner = ""  # the owner lease value every write is fenced by ('' = unchecked)
        # Takes the owner lease again when it ran out with nobody taking it (offloadd.log.owner)
        self.retake_owner: Callable[[], Awaitable[str]] | None = None

    def _fixed_ops(self) -> Ops:
        return Ops([self.keys.head, self.keys.log, self.keys.sources, self.keys.owner])

    def wait_for_replicas(self, replicas: int, timeout_ms: int) -> None:
        """Acknowledge appends only once ``replicas`` replicas have them (DECISIONS 40), and
        settle a write in doubt as landed only once they have it too (DECISIONS 59)."""
        waited = WaitedScript(self.client, self._script, replicas, timeout_ms)
        self._script = waited
        self._confirm = waited.confirm

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
        return await asyncio.shield(self.submit(item))  # a cancelled caller must not cancel the write

    def submit(self, item: Append) -> asyncio.Future[LogRecord]:
        """Queue ``item`` for the next write without a task of the caller's own (what ``append``
        awaits): the future is the record once durable and applied, or what ``append`` raises.
        Nothing cancels it but its holder, who must not (the write goes on regardless)."""
        assert item.events, "never append an empty record"
        future: asyncio.Future[LogRecord] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._drain())
        return future

    async def _drain(self) -> None:
        while self._queue:
            group, self._queue = self._queue[:_GROUP_MAX], self._queue[_GROUP_MAX:]
            async with self._lock:
                try:
                    await self._write_group(group)
                except Exception as exc:  # a bug in the writer: never hang callers, undo theirs
                    log.exception("append failed")
                    fail(group, exc, is_reverted=self._in_doubt is None)

    async def _write_group(self, group: list[Pending]) -> None:
        """Write ``group`` in one script call. An append that cannot be written (its record does
        not encode, its projection raises, the log holds its position) fails alone and is
        reverted; the others are written."""
        try:
            await self._resolve_locked()
        except (RedisUnavailable, LogConflict) as exc:
            fail(group, exc)
            return
        while True:
            group = [p for p in group if not p[1].done()]
            batch = encode_group(group, self.head)
            group = [p for p in group if not p[1].done()]  # refused: what cannot encode
            if not batch:
                return
            try:
                await self._write(batch)
            except ProjectFailed as exc:
                mine = [p for p in group if p[0] is exc.item]
                if isinstance(exc.__cause__, RecordRefused):  # refused by its own rule (ChainBroken)
                    log.info("%s: %s; writing the rest of its group without it", exc, exc.__cause__)
                    fail(mine, exc.__cause__)
                    continue
                log.error("%s; writing the rest of its group without it", exc, exc_info=exc.__cause__)
                fail(mine, RecordRefused(f"record not written: {exc.__cause__!r}"), exc.__cause__)
                continue
            except AlreadyLogged as exc:  # never twice in the log, whatever memory believed
                record = batch[exc.index][0]
                log.error("%s; writing the rest of its group without it", exc)
                fail([p for p in group if p[0] is batch[exc.index][2]], AlreadyLogged(
                    f"record of {record.source} (incarnation {record.incarnation}, seq "
                    f"{record.source_seq}) not written: the log already holds that position "
                    f"of its source or a later one", exc.index))
                continue
            except LogConflict as exc:  # refused by the script: nothing written
                fail(group, exc)
                return
            except (RedisError, OSError) as exc:
                self._in_doubt = batch
                what = ("replicas behind" if isinstance(exc, ReplicasBehind) else "refused the write"
                        if isinstance(exc, ResponseError) else "unreachable")
                fail(group, WriteInDoubt(f"Redis {what}, record not applied: {exc}"), exc,
                      is_reverted=False)
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

    async def _write(self, batch: Batch) -> None:
        ops = self._fixed_ops()
        records: list[Any] = []
        for record, data, item in batch:
            records += (entry_id(record.offset), data, record.source,
                        projection.encode((record.incarnation, record.source_seq)))
            try:
                item.project(ops)
            except Exception as exc:  # nothing was sent: the group is rebuilt without it
                raise ProjectFailed(item) from exc
        await self._run(ops, [self.head, self.owner, len(batch), batch[-1][0].offset,
                              *records, *ops.args])

    async def refence(self) -> None:
        """Retake a lease that ran out, between two writes (the renewal's path)."""
        async with self._lock:
            if self.retake_owner is not None:
                self.owner = await self.retake_owner()

    async def _run(self, ops: Ops, args: list[Any]) -> None:
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
        if code == "head" and detail[0].isdigit() and int(detail[0]) < self.head:
            # a failover lost records
            raise LogConflict(await end_rewound_log(self.client, self.keys, self.owner,
                                                    int(detail[0]), self.head))
        raise refusal(code, detail, self.keys, self.head, self.repair_hint())

    def _commit_locked(self, batch: Batch) -> list[Exception | None]:
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
        try:
            landed = await read_back(self.client, self.keys, batch, self.head, self.owner,
                                     self._confirm)
        except LogConflict:
            self._in_doubt = None  # settled: the log is not the daemon's (it stops)
            raise
        self._in_doubt = None
        if landed:
            self._commit_locked(batch)
            return
        for _, _, item in reversed(batch):
            revert(item)  # one revert that raises must not leak the others' slots

    async def write_registration(self, layouts: list[LayoutRecord], engine: EngineRecord | None) -> None:
        """Persist layouts (ids, chunk counts) and an engine registration; not a log record,
        but fenced by the owner lease like one."""
        ops = self._fixed_ops()
        for rec in layouts:
            ops.hset(self.keys.layouts, rec.identity, projection.encode(rec))
        if engine is not None:
            ops.hset(self.keys.engines, engine.engine_id, projection.encode(engine))
        await self._run_unlogged(ops, "registration not saved")

    async def _run_unlogged(self, ops: Ops, what: str) -> None:
        try:
            await self._run(ops, ["", self.owner, 0, 0, *ops.args])
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(f"Redis unreachable, {what}: {exc}") from exc

    def next_append(self) -> asyncio.Event:
        """An event set at the next append: take it before reading, wait on it after."""
        return self._appended

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
        ops = self._fixed_ops()
        ops.hset(self.keys.daemon, mapping=fields)
        await self._run_unlogged(ops, "daemon fields not saved")
