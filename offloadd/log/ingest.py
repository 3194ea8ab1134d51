"""Ingest of engines' events, fenced by (engine_id, incarnation, seq).

- seq ``<=`` the last applied one of the incarnation: DUPLICATE, acked, not applied again;
- seq beyond the next one: RESEND from the next one (nothing is applied out of order);
- a newer incarnation must start at seq 1; its first record first clears the engine's GPU tier
  (an explicit ``AllBlocksCleared(GPU)`` when the old incarnation had blocks; without a medium,
  every tier, when the source also held CPU-tier blocks of its own);
- an older incarnation, an empty or oversize batch: REJECTED with a message (the stream stays
  open; IngestStream answers by starting a new incarnation).
A ``medium`` "CPU" event from a source is that source's own CPU tier (a vLLM engine's CPU
offloading, appended by kv-ingest), never the daemon's (which is the source ``offloadd``, a
name no engine may use).
Engines need not be registered to publish events (events only; RegisterEngine is for the arena).

Batches are pipelined (``submit``): the next batch of an incarnation is fenced against the last
one handed to the log before that one is durable, so one stream's batches share Redis writes.
Any other batch is fenced against the state once no write is in doubt (``MetadataStore.resolve``
first): a resend of a batch whose write's reply was lost is then a DUPLICATE, not a second
record. The log refuses a position it holds itself too (offloadd.log.write_script); a batch
refused so (``AlreadyLogged``) is answered DUPLICATE.
The acks are those of handling the batches one at a time, and nothing after a batch that was not
written is written: its successors are refused as their write is built (``ChainBroken``). A batch
whose write is in doubt (``WriteInDoubt``: its reply lost, or its replicas late) does not break the
chain by itself: the writer settles the doubt before it builds the next write, and only a write
that did not land is reverted, which breaks it (DECISIONS 59).

Every ack carries the log's epoch (``LogKeys.epoch``, set by recovery): an engine whose acks
change epoch, or that is asked to resend batches it already had acked, knows the log lost its
batches and re-announces its GPU tier under a new incarnation (offloadd.client.ingest_stream).

An engine that departs (offloadd.log.liveness decides when) gets ``clear_departed``: one record
``AllBlocksCleared(GPU)`` (every tier when it held its own CPU tier) under its source with
incarnation 0, which the reducer applies without
fencing. The source's fence stays ``(incarnation, last_seq)``, so a late batch N+1 of the same
incarnation still applies (the engine was alive after all: its new blocks are logged again), a
duplicate is still a duplicate, and an older incarnation is still fenced out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from events.codec_proto import EventBatch
from events.schema import AllBlocksCleared, Event, LogRecord
from events.state import CacheState
from offloadd.config import DEFAULT_MAX_ID_BYTES
from offloadd.log import projection
from offloadd.log.metadata import (
    AlreadyLogged,
    Append,
    MetadataStore,
    RecordRefused,
    RedisUnavailable,
    WriteInDoubt,
)
from offloadd.log.projection import Pipe
from offloadd.tier.source import DAEMON_SOURCE

_MAX_DEPARTED = 65536  # engines remembered as cleared by the daemon


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


@dataclass
class _Chain:
    """An engine's batches handed to the log and not yet settled, in seq order. The next batch
    of the same incarnation is fenced against the last of them rather than waiting for it to be
    durable; once one fails (``is_broken``) none after it is written (``Ingest._append``)."""

    incarnation: int
    last_seq: int
    num_pending: int = 0
    is_broken: bool = False
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # set when none is pending


class ChainBroken(RecordRefused):
    """An earlier batch of the engine was not written, so this one must not be either."""


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
        self._chains: dict[str, _Chain] = {}  # per engine, only while it has batches pending
        # Engines whose GPU tier the daemon cleared (departed, or unknown after a restart): their
        # next batch of the same incarnation gets RESEND from 1, so the engine starts a new one
        # and re-announces what it holds instead of adding to a tier the log says is empty.
        self._departed: dict[str, None] = {}
        self.num_applied = 0
        self.num_events = 0
        self.num_duplicate = 0
        self.num_resend = 0
        self.num_rejected = 0
        self.log_epoch = ""  # read from Redis once (recovery sets it before serving)

    async def publish(self, batch: EventBatch) -> Ack:
        """Fence and apply one batch; raises RedisUnavailable when it cannot be made durable."""
        return await (await self.submit(batch))

    async def submit(self, batch: EventBatch) -> asyncio.Future[Ack]:
        """Fence ``batch`` and hand it to the log without waiting for it to be durable; the
        future is its ack, or raises what ``publish`` raises. Batches are fenced in the order
        submitted, and the acks are exactly those of publishing them one after the other: a
        batch that follows an engine's pending one is fenced against it, anything else waits
        until the engine has none pending. Raises RedisUnavailable when the epoch is unknown."""
        epoch = self.log_epoch or await self.epoch()
        if len(batch.engine_id.encode()) > self.max_id_bytes:
            return self._answer(Ack(AckStatus.REJECTED,
                                    message=f"engine_id is longer than {self.max_id_bytes} bytes"))
        entry = self._hold(batch.engine_id)
        try:
            async with entry.lock:
                fenced = await self._fence(batch)
        finally:
            self._let_go(batch.engine_id, entry)
        if isinstance(fenced, Ack):
            return self._answer(dataclasses.replace(fenced, log_epoch=epoch))
        return fenced

    def _answer(self, ack: Ack) -> asyncio.Future[Ack]:
        if ack.status is AckStatus.DUPLICATE:
            self.num_duplicate += 1
        elif ack.status is AckStatus.RESEND:
            self.num_resend += 1
        elif ack.status is AckStatus.REJECTED:
            self.num_rejected += 1
        answer: asyncio.Future[Ack] = asyncio.get_running_loop().create_future()
        answer.set_result(ack)
        return answer

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

    def _hold(self, engine_id: str) -> _EngineLock:
        """``engine_id``'s lock entry, counted as used until ``_let_go``. One engine's batches
        are fenced one at a time, even across streams; the entry lives only while someone
        holds or waits on it, so rejected input leaves nothing behind."""
        entry = self._locks.get(engine_id)
        if entry is None:
            entry = self._locks[engine_id] = _EngineLock()
        entry.users += 1
        return entry

    def _let_go(self, engine_id: str, entry: _EngineLock) -> None:
        entry.users -= 1
        if entry.users == 0:
            del self._locks[engine_id]

    async def _fence(self, batch: EventBatch) -> Ack | asyncio.Future[Ack]:
        """Under the engine's lock: the ack, or the future ack of the append started."""
        chain = self._chains.get(batch.engine_id)
        if chain is not None:
            if (not chain.is_broken and batch.incarnation == chain.incarnation
                    and batch.seq == chain.last_seq + 1 and not self._problem(batch)):
                return self._start_append(batch, batch.events, chain)
            await self._settled(batch.engine_id)
        # A write in doubt may hold this very batch (a resend after a lost reply): fence
        # against what the log holds, never against memory that has not heard of it yet.
        await self.metadata.resolve()
        fenced = self._check(batch)
        if isinstance(fenced, Ack):
            return fenced
        chain = self._chains[batch.engine_id] = _Chain(batch.incarnation, batch.seq - 1)
        return self._start_append(batch, fenced, chain)

    async def _settled(self, engine_id: str) -> None:
        """Until none of the engine's batches is pending (the state holds them all)."""
        chain = self._chains.get(engine_id)
        if chain is not None:
            await chain.settled.wait()

    def _check(self, batch: EventBatch) -> Ack | tuple[Event, ...]:
        """Fence against the state (nothing pending): the ack, or the events to append."""
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
        if batch.engine_id in self._departed:
            if not new_incarnation:
                return Ack(AckStatus.RESEND, acked_seq=0, resend_from=1, message=(
                    "this engine's GPU tier was cleared when it was taken for departed: start a "
                    "new incarnation and re-announce what it holds"))
            del self._departed[batch.engine_id]
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
        if new_incarnation and fence is not None and self._has_blocks(batch.engine_id):
            return (self._clear_all(batch.engine_id), *batch.events)
        return batch.events

    def _start_append(self, batch: EventBatch, events: tuple[Event, ...],
                      chain: _Chain) -> asyncio.Future[Ack]:
        chain.num_pending += 1
        chain.last_seq = batch.seq
        acked: asyncio.Future[Ack] = asyncio.get_running_loop().create_future()
        # The log's own future, answered by its writer: no task per batch (each one a few loop
        # turns on the path of every paced batch, DECISIONS 73).
        written = self._append(batch, events, chain)
        written.add_done_callback(lambda w: self._appended(w, acked, batch, chain))
        return acked

    def _appended(self, written: asyncio.Future[LogRecord], acked: asyncio.Future[Ack],
                  batch: EventBatch, chain: _Chain) -> None:
        chain.num_pending -= 1
        exc = asyncio.CancelledError() if written.cancelled() else written.exception()
        if exc is not None and not isinstance(exc, WriteInDoubt):
            chain.is_broken = True  # in doubt: broken by its revert if it did not land
        else:
            self.num_applied += 1
            self.num_events += len(batch.events)
        if chain.num_pending == 0:
            chain.settled.set()
            if self._chains.get(batch.engine_id) is chain:
                del self._chains[batch.engine_id]
        if acked.done():
            return  # the stream that waited for it is gone
        if isinstance(exc, AlreadyLogged):  # the log refused it as its twin: a duplicate
            self.num_duplicate += 1
            acked.set_result(Ack(AckStatus.DUPLICATE, acked_seq=batch.seq, log_epoch=self.log_epoch))
        elif exc is not None:
            acked.set_exception(exc)
        else:
            acked.set_result(Ack(AckStatus.APPLIED, acked_seq=batch.seq,
                                 log_offset=written.result().offset, log_epoch=self.log_epoch))

    def _problem(self, batch: EventBatch) -> str:
        if not batch.events:
            return "empty batch: send events only when there are some"
        if len(batch.events) > self.max_batch_events:
            return f"batch has {len(batch.events)} events, the limit is {self.max_batch_events}"
        return ""

    def _has_blocks(self, engine_id: str) -> bool:
        return any(s == engine_id for s, _, _ in self.state.counts())

    def _clear_all(self, engine_id: str) -> AllBlocksCleared:
        """What clears every tier a source holds: ``AllBlocksCleared(GPU)`` for our engines (they
        own a GPU tier only), every tier (no medium) for a source that also holds its own CPU
        tier (a vLLM engine's CPU offloading, followed by kv-ingest)."""
        own_cpu = any(s == engine_id and m != "GPU" for s, m, _ in self.state.counts())
        return AllBlocksCleared(None if own_cpu else "GPU")

    def _append(self, batch: EventBatch, events: tuple[Event, ...],
                chain: _Chain) -> asyncio.Future[LogRecord]:
        engine_id = batch.engine_id

        def project(pipe: Pipe) -> None:  # the record is all: no per-block projection (DECISIONS 33)
            if chain.is_broken:  # checked as the write is built: after every earlier batch's
                raise ChainBroken(f"an earlier batch of {engine_id} was not written")

        def revert() -> None:  # not written: neither may any later batch of the chain be
            chain.is_broken = True

        return self.metadata.submit(Append(
            engine_id, batch.incarnation, batch.seq, events, project, _no_apply, revert,
            ts=batch.ts,
        ))

    async def clear_departed(self, engine_id: str) -> LogRecord | None:
        """Log the clear of a departed engine's tiers (``_clear_all``); None (nothing logged)
        when it holds no blocks. Raises RedisUnavailable when it cannot be made durable."""
        entry = self._hold(engine_id)
        try:
            async with entry.lock:  # fenced one at a time with its batches
                await self._settled(engine_id)
                await self.metadata.resolve()  # its last batch may be in a write in doubt
                return await self._clear_departed(engine_id)
        finally:
            self._let_go(engine_id, entry)

    async def _clear_departed(self, engine_id: str) -> LogRecord | None:
        if not self._has_blocks(engine_id):
            return None
        keys = self.metadata.keys
        events: tuple[Event, ...] = (self._clear_all(engine_id),)

        def project(pipe: Pipe) -> None:  # the fence as the write is built: what the log holds
            fence = self.state.fence(engine_id)
            if fence is not None:  # the append wrote (0, 0): the fence is unchanged
                pipe.hset(keys.sources, engine_id, projection.encode(fence))

        record = await self.metadata.append(Append(
            engine_id, 0, 0, events, project, lambda record: None,
        ))
        self.expect_resync((engine_id,))
        return record

    def expect_resync(self, engine_ids: Iterable[str]) -> None:
        """Engines whose next batch of their current incarnation must restart them (above);
        bounded: the oldest marks go first (their engine then merely adds to a cleared tier)."""
        for engine_id in engine_ids:
            self._departed[engine_id] = None
        while len(self._departed) > _MAX_DEPARTED:
            del self._departed[next(iter(self._departed))]


def _no_apply(record: LogRecord) -> None:
    """The reducer (applied by the metadata store) holds the GPU tiers."""
