"""Ingest of engines' GPU-tier events, fenced by (engine_id, incarnation, seq).

- seq ``<=`` the last applied one of the incarnation: DUPLICATE, acked, not applied again;
- seq beyond the next one: RESEND from the next one (nothing is applied out of order);
- a newer incarnation must start at seq 1; its first record first clears the engine's GPU tier
  (an explicit ``AllBlocksCleared(GPU)`` when the old incarnation had blocks);
- an older incarnation, an empty or oversize batch, or a non-GPU event: REJECTED with a message
  (the stream stays open; IngestStream answers by starting a new incarnation).
Engines need not be registered to publish events (events only; RegisterEngine is for the arena).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from events.codec_proto import EventBatch
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, Event, LogRecord
from events.state import CacheState
from offloadd.log.metadata import Append, MetadataStore
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


class Ingest:
    def __init__(self, metadata: MetadataStore, state: CacheState, max_batch_events: int) -> None:
        self.metadata = metadata
        self.state = state
        self.max_batch_events = max_batch_events
        self._locks: dict[str, asyncio.Lock] = {}
        self.num_applied = 0
        self.num_events = 0
        self.num_duplicate = 0
        self.num_resend = 0
        self.num_rejected = 0

    async def publish(self, batch: EventBatch) -> Ack:
        """Fence and apply one batch; raises RedisUnavailable when it cannot be made durable."""
        lock = self._locks.setdefault(batch.engine_id, asyncio.Lock())
        async with lock:  # one engine's batches are fenced one at a time, even across streams
            ack = await self._publish(batch)
        if ack.status is AckStatus.DUPLICATE:
            self.num_duplicate += 1
        elif ack.status is AckStatus.RESEND:
            self.num_resend += 1
        elif ack.status is AckStatus.REJECTED:
            self.num_rejected += 1
        return ack

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
