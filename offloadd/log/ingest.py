"""Ingest of engines' GPU-tier events, fenced by (engine_id, incarnation, seq).

- seq ``<=`` the last applied one of the incarnation: DUPLICATE, acked, not applied again;
- seq beyond the next one: RESEND from the next one (nothing is applied out of order);
- a newer incarnation must start at seq 1; its first record first clears the engine's GPU tier
  (an explicit ``AllBlocksCleared(GPU)`` when the old incarnation had blocks);
- an older incarnation, an empty or oversize batch, or a non-GPU event: REJECTED with a message
  (the stream stays open; IngestStream answers by starting a new incarnation).
Engines need not be registered to publish events (events only; RegisterEngine is for the arena).

Every ack carries the log's epoch (``LogKeys.epoch``, set by recovery): an engine whose acks
change epoch, or that is asked to resend batches it already had acked, knows the log lost its
batches and re-announces its GPU tier under a new incarnation (offloadd.client.ingest_stream).

An engine that departs (offloadd.log.liveness decides when) gets ``clear_departed``: one record
``AllBlocksCleared(GPU)`` under its source with incarnation 0, which the reducer applies without
fencing. The source's fence stays ``(incarnation, last_seq)``, so a late batch N+1 of the same
incarnation still applies (the engine was alive after all: its new blocks are logged again), a
duplicate is still a duplicate, and an older incarnation is still fenced out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from events.codec_proto import EventBatch
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, Event, LogRecord
from events.state import CacheState
from offloadd.config import DEFAULT_MAX_ID_BYTES
from offloadd.log import projection
from offloadd.log.metadata import Append, MetadataStore, RedisUnavailable
from offloadd.log.projection import Pipe, project_gpu_events
from offloadd.tier.source import DAEMON_SOURCE


class AckStatus(enum.IntEnum):
    """Values equal to kvcache.v1.PublishAck.Status."""

    APPLIED = 1
    DUPLICATE = 2
    RESEND = 3
    REJECTED = 4


@dataclass(frozen=True)
class Ack:
    status: AckStatus
    acked_seq: int = 0
    resend_from: int = 0
    log_offset: int = 0
    message: str = ""
    log_epoch: str = ""


@dataclass
class _EngineLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # holders and waiters


class Ingest:
    def __init__(
        self, metadata: MetadataStore, state: CacheState, max_batch_events: int,
        max_id_bytes: int = DEFAULT_MAX_ID_BYTES,
    ) -> None:
        self.metadata = metadata
        self.state = state
        self.max_batch_events = max_batch_events
        self.max_id_bytes = max_id_bytes
        self._locks: dict[str, _EngineLock] = {}  # per engine, only while someone uses it
        self.num_applied = 0
        self.num_events = 0
        self.num_duplicate = 0
        self.num_resend = 0
        self.num_rejected = 0
        self.log_epoch = ""  # read from Redis once (recovery sets it before serving)

    async def publish(self, batch: EventBatch) -> Ack:
        """Fence and apply one batch; raises RedisUnavailable when it cannot be made durable."""
        if len(batch.engine_id.encode()) > self.max_id_bytes:
            ack = Ack(AckStatus.REJECTED, message=f"engine_id is longer than {self.max_id_bytes} bytes")
        else:
            ack = await self._publish_locked(batch)
        if ack.status is AckStatus.DUPLICATE:
            self.num_duplicate += 1
        elif ack.status is AckStatus.RESEND:
            self.num_resend += 1
        elif ack.status is AckStatus.REJECTED:
            self.num_rejected += 1
        return dataclasses.replace(ack, log_epoch=await self.epoch())

    async def epoch(self) -> str:
        """The log's epoch, read once; "" when Redis has none (a log older than epochs)."""
        if not self.log_epoch:
            md = self.metadata
            try:
                raw = await md.client.get(md.keys.epoch)
            except (RedisError, OSError) as exc:
                raise RedisUnavailable(f"Redis unreachable: {exc}") from exc
            self.log_epoch = raw.decode() if isinstance(raw, bytes) else (raw or "")
        return self.log_epoch

    async def _publish_locked(self, batch: EventBatch) -> Ack:
        """One engine's batches are fenced one at a time, even across streams; its lock lives
        only while someone holds or waits on it, so rejected input leaves nothing behind."""
        async with self._engine_lock(batch.engine_id):
            return await self._publish(batch)

    @contextlib.asynccontextmanager
    async def _engine_lock(self, engine_id: str) -> AsyncIterator[None]:
        """Hold ``engine_id``'s lock; its entry lives only while held or waited on."""
        entry = self._locks.get(engine_id)
        if entry is None:
            entry = self._locks[engine_id] = _EngineLock()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._locks[engine_id]

    async def _publish(self, batch: EventBatch) -> Ack:
        if batch.engine_id == DAEMON_SOURCE:
            return Ack(AckStatus.REJECTED, message=f"engine_id {DAEMON_SOURCE!r} is reserved")
        if batch.incarnation == 0:
            return Ack(AckStatus.REJECTED, message="incarnation must be > 0")
        if batch.seq == 0:
            return Ack(AckStatus.REJECTED, message="seq starts at 1")
        fence = self.state.fence(batch.engine_id)
        new_incarnation = fence is None or batch.incarnation > fence[0]
        if fence is not None and batch.incarnation < fence[0]:
            return Ack(
                AckStatus.REJECTED, message=f"incarnation {batch.incarnation} is fenced out "
                f"(current incarnation is {fence[0]})",
            )
        if fence is not None and not new_incarnation:
            last = fence[1]
            if batch.seq <= last:
                return Ack(AckStatus.DUPLICATE, acked_seq=last)
            if batch.seq > last + 1:
                return Ack(AckStatus.RESEND, acked_seq=last, resend_from=last + 1,
                           message=f"gap: expected seq {last + 1}, got {batch.seq}")
        elif batch.seq != 1:
            return Ack(AckStatus.RESEND, resend_from=1,
                       message=f"incarnation {batch.incarnation} must start at seq 1")
        problem = self._problem(batch)
        if problem:
            return Ack(AckStatus.REJECTED, acked_seq=batch.seq - 1, message=problem)
        events: tuple[Event, ...] = batch.events
        if new_incarnation and fence is not None and self._has_blocks(batch.engine_id):
            events = (AllBlocksCleared("GPU"), *events)
        record = await self._append(batch, events)
        self.num_applied += 1
        self.num_events += len(batch.events)
        return Ack(AckStatus.APPLIED, acked_seq=batch.seq, log_offset=record.offset)

    def _problem(self, batch: EventBatch) -> str:
        if not batch.events:
            return "empty batch: send events only when there are some"
        if len(batch.events) > self.max_batch_events:
            return f"batch has {len(batch.events)} events, the limit is {self.max_batch_events}"
        for i, event in enumerate(batch.events):
            medium = event.medium
            if isinstance(event, BlockStored | BlockRemoved) and medium != "GPU":
                return f"events[{i}]: engines publish GPU-tier events only, got medium {medium!r}"
            if isinstance(event, AllBlocksCleared) and medium not in (None, "GPU"):
                return f"events[{i}]: engines clear their GPU tier only, got medium {medium!r}"
        return ""

    def _has_blocks(self, engine_id: str) -> bool:
        return any(s == engine_id for s, _, _ in self.state.counts())

    async def _append(self, batch: EventBatch, events: tuple[Event, ...]) -> LogRecord:
        keys = self.metadata.keys

        def project(pipe: Pipe) -> None:
            project_gpu_events(pipe, keys, batch.engine_id, events)

        def apply(record: LogRecord) -> None:
            pass  # the reducer (applied by the metadata store) holds the GPU tiers

        return await self.metadata.append(Append(
            batch.engine_id, batch.incarnation, batch.seq, events, project, apply, ts=batch.ts,
        ))

    async def clear_departed(self, engine_id: str) -> LogRecord | None:
        """Log ``AllBlocksCleared(GPU)`` for a departed engine; None (nothing logged) when it
        holds no GPU blocks. Raises RedisUnavailable when it cannot be made durable."""
        async with self._engine_lock(engine_id):  # fenced one at a time with its batches
            if not self._has_gpu_blocks(engine_id):
                return None
            fence = self.state.fence(engine_id)
            keys = self.metadata.keys
            events: tuple[Event, ...] = (AllBlocksCleared("GPU"),)

            def project(pipe: Pipe) -> None:
                project_gpu_events(pipe, keys, engine_id, events)
                if fence is not None:  # the append wrote (0, 0): the fence is unchanged
                    pipe.hset(keys.sources, engine_id, projection.encode(fence))

            return await self.metadata.append(Append(
                engine_id, 0, 0, events, project, lambda record: None,
            ))

    def _has_gpu_blocks(self, engine_id: str) -> bool:
        return any(s == engine_id and m == "GPU" for s, m, _ in self.state.counts())
