"""IngestStream: an engine's event transport to offloadd (EventIngest.Publish), on a thread.

``submit(events)`` never blocks generation: it assigns the next seq and queues the batch. A
background thread keeps one Publish stream open, sends unacked batches in seq order, drops
them once acked (APPLIED or DUPLICATE), rewinds on RESEND, and after any stream error
reconnects with backoff and resends every unacked batch.

The unacked queue is bounded. When it is full, or when the daemon REJECTS a batch, the stream
cannot continue truthfully (the lost batch would leave a gap forever), so it starts a new
incarnation: the daemon then clears this engine's GPU tier, and the log under-reports rather
than claims blocks that are gone. ``on_reset(new_incarnation)`` lets the engine re-announce
what it still holds (it is called on the engine's thread for a full queue, on the stream's
thread otherwise). Every such drop is counted and logged.

The log has an identity (its epoch, on every ack, DESIGN 3.5). When an ack carries another
epoch than the first one, or the daemon asks to resend batches it had already acked (the
batches and the fence are gone: Redis lost the log), no resend can repair it: the stream starts
a new incarnation too, instead of resending forever.

Every batch fits gRPC's message size (``max_message_bytes``, DECISIONS 45): a larger one is
split into consecutive seqs by events, and an event by blocks (offloadd.client.batch_split); a
block too big alone is left out, counted (``num_oversize``) and reported to ``on_oversize``.
When the daemon's limit is smaller than ours (its stream fails with RESOURCE_EXHAUSTED), the
stream takes the daemon's limit and splits again the unacked batches from the first one too big,
instead of resending it forever.

With ``on_reset``, a reset closes the stream to new batches until the engine calls
:meth:`resync` with everything it holds: batches submitted meanwhile are dropped (the
re-announce covers them), so the new incarnation starts with ``AllBlocksCleared`` and the whole
GPU tier, never with a delta about blocks it has not announced.

``incarnation`` must be new for every life of an engine (the default is time-based): batches of
a reused incarnation at seqs the daemon already has would be acked as duplicates. When the
daemon acks a seq beyond any this stream assigned, that reuse is certain and the stream resets.
It resets too when the daemon answers a batch with RESEND from that very batch (or an earlier
acked one): the daemon cleared this engine's tier (it took it for departed, perhaps while the
previous life of a reused incarnation left) and takes no more of this incarnation.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from kvcache.v1 import events_pb2, log_pb2, log_pb2_grpc

from events.codec_proto import EventBatch, batch_to_proto
from events.schema import AllBlocksCleared, Event
from offloadd.client.batch_split import DEFAULT_MAX_MESSAGE_BYTES, BatchTooLarge, fit_batches
from rpc.tls import ClientSecurity

log = logging.getLogger(__name__)

_APPLIED, _DUPLICATE, _RESEND, _REJECTED = 1, 2, 3, 4
_PEER_LIMIT = re.compile(r"larger than max \(\d+ vs\. (\d+)\)")  # gRPC's words for it
_MIN_MESSAGE_BYTES = 4096


def new_incarnation(previous: int = 0) -> int:
    """Time-based, so a restarted engine always fences out its previous life."""
    return max(previous + 1, time.time_ns() // 1000)


class IngestStream:
    def __init__(
        self, target: str, engine_id: str, incarnation: int | None = None, *,
        max_pending: int = 1024, max_batch_events: int = 4096,
        backoff_s: tuple[float, float] = (0.05, 2.0),
        on_reset: Callable[[int], None] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        on_oversize: Callable[[BatchTooLarge], None] | None = None,
        credentials: grpc.ChannelCredentials | None = None, token: str | None = None,
    ) -> None:
        self.target = target
        self.engine_id = engine_id
        self.incarnation = incarnation or new_incarnation()
        self.max_pending = max_pending
        self.max_batch_events = max_batch_events
        self.on_reset = on_reset
        if max_message_bytes < _MIN_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes: must be >= {_MIN_MESSAGE_BYTES}, got {max_message_bytes}")
        self.max_message_bytes = max_message_bytes
        self.on_oversize = on_oversize
        self._backoff = backoff_s
        self._cond = threading.Condition()
        self._pending: OrderedDict[int, events_pb2.EventBatch] = OrderedDict()
        self._next_seq = 1
        self._send_from = 1
        self._rewind_mark = 0
        self._acked = 0
        self._connected = False
        self._closed = False
        self._call: Any = None
        self.num_dropped = 0  # batches dropped by resets (queue full or rejected)
        self.num_resets = 0
        self.num_reconnects = 0
        self.num_oversize = 0  # events (or single blocks) left out: too big for one message
        self.last_error = ""
        self.log_epoch = ""  # the epoch of the log this stream's batches went to
        self._awaiting_resync = False  # after a reset with on_reset: drop until resync()
        self._channel = ClientSecurity(credentials, token).channel(target)
        self._stub = log_pb2_grpc.EventIngestStub(self._channel)
        self._thread = threading.Thread(target=self._run, name=f"ingest-{engine_id}", daemon=True)
        self._thread.start()

    # -- engine side ----------------------------------------------------------------------

    def submit(self, events: Sequence[Event]) -> int:
        """Queue ``events`` (split into batches of at most max_batch_events); returns the last
        seq assigned, or 0 when ``events`` is empty (nothing is sent)."""
        if not events:
            return 0
        chunks = self._split(events)
        with self._cond:
            if self._closed:
                raise RuntimeError("IngestStream is closed")
            full = len(self._pending) + len(chunks) > self.max_pending
        if full:
            log.warning("ingest queue full (%d unacked); starting a new incarnation",
                        len(self._pending))
            self._reset("unacked queue full")
        with self._cond:
            if self._awaiting_resync:  # the engine's re-announce will cover these events
                self.num_dropped += len(chunks)
                return 0
            return self._queue(chunks)

    def resync(self, events: Sequence[Event]) -> int:
        """Queue ``AllBlocksCleared(GPU)`` then ``events`` (everything the engine holds, in one
        first batch when it fits) and open the stream again after a reset; returns the last seq."""
        chunks = self._split([AllBlocksCleared("GPU"), *events])
        with self._cond:
            if self._closed:
                raise RuntimeError("IngestStream is closed")
            self._awaiting_resync = False
            return self._queue(chunks)

    def _split(self, events: Sequence[Event]) -> list[events_pb2.EventBatch]:
        """``events`` as batches that fit (numbered by ``_queue``); what cannot fit is reported."""
        whole = batch_to_proto(EventBatch(self.engine_id, 0, 0, 0.0, tuple(events)))
        batches, refused = fit_batches([whole], self.max_message_bytes, self.max_batch_events)
        self._refused(refused)
        return batches

    def _refused(self, refused: list[BatchTooLarge]) -> None:
        for exc in refused:
            self.num_oversize += exc.left_out
            self.last_error = str(exc)
            log.error("ingest: %s", exc)
            if self.on_oversize is not None:
                self.on_oversize(exc)

    def _queue(self, chunks: list[events_pb2.EventBatch]) -> int:
        """Number and queue ``chunks``; the caller holds ``_cond``."""
        seq = 0
        now = time.time()
        for chunk in chunks:
            seq = self._next_seq
            self._next_seq += 1
            chunk.incarnation, chunk.seq, chunk.ts = self.incarnation, seq, now
            self._pending[seq] = chunk
        self._cond.notify_all()
        return seq

    def _reset(self, why: str) -> None:
        with self._cond:
            self.num_dropped += len(self._pending)
            self.num_resets += 1
            self._pending.clear()
            self.incarnation = new_incarnation(self.incarnation)
            self._next_seq = self._send_from = 1
            self._rewind_mark = 0
            self._acked = 0
            self.last_error = why
            self._awaiting_resync = self.on_reset is not None
            incarnation = self.incarnation
            self._cond.notify_all()
        log.warning("ingest reset (%s): new incarnation %d", why, incarnation)
        if self.on_reset is not None:
            self.on_reset(incarnation)

    @property
    def is_connected(self) -> bool:
        return self._connected

    @property
    def acked_seq(self) -> int:
        return self._acked

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted batch is acked; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout_s)

    def close(self, timeout_s: float = 1.0) -> None:
        """Half-close the stream, so the daemon reads a clean departure and clears this engine's
        GPU tier at once (DESIGN 3.7); cancel it when the daemon has not ended the call within
        ``timeout_s`` (unreachable, or busy)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            with self._cond:
                call = self._call
            if call is not None:
                call.cancel()
            self._thread.join(timeout=5)
        self._channel.close()

    # -- stream thread --------------------------------------------------------------------

    def _run(self) -> None:
        delay = self._backoff[0]
        while not self._closed:
            with self._cond:
                self._send_from = next(iter(self._pending), self._next_seq)
                self._rewind_mark = 0
                # The header names whose liveness this stream is, before any batch (3.7).
                self._call = self._stub.Publish(
                    self._requests(), metadata=(("kvd-engine-id", self.engine_id),))
                call = self._call
            try:
                for ack in call:
                    self._connected = True
                    delay = self._backoff[0]
                    self._on_ack(ack)
            except grpc.RpcError as exc:
                if self._closed:
                    break
                self.last_error = f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
                log.info("ingest stream error, reconnecting: %s", self.last_error)
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # type: ignore[attr-defined]
                    self._shrink(exc.details() or "")  # type: ignore[attr-defined]
            self._connected = False
            self.num_reconnects += 1
            with self._cond:
                self._cond.wait_for(lambda: self._closed, delay)
            delay = min(delay * 2, self._backoff[1])

    def _shrink(self, details: str) -> None:
        """The daemon refused a message as too big: take its limit (or half ours when it did not
        say) and split again the unacked batches from the first one above it. No seq from that
        one on reached the daemon (the stream ends at the refused message), so they may be
        numbered anew; the earlier ones keep their seqs (they may be applied, their acks lost)."""
        said = _PEER_LIMIT.search(details)
        limit = max(_MIN_MESSAGE_BYTES, min(int(said.group(1)), self.max_message_bytes) if said
                    else self.max_message_bytes // 2)
        with self._cond:
            self.max_message_bytes = limit
            first = next((seq for seq, b in self._pending.items() if b.ByteSize() > limit), 0)
            tail = [self._pending.pop(seq) for seq in list(self._pending) if first and seq >= first]
            batches, refused = fit_batches(tail, limit, self.max_batch_events)
            if first:
                self._next_seq = first
                self._queue(batches)
        log.warning("ingest: offloadd refused a message as too big (%s); batches now at most %d "
                    "bytes (split again from seq %d)", details, limit, first)
        self._refused(refused)

    def _requests(self) -> Iterator[events_pb2.EventBatch]:
        with self._cond:
            mine = self._call  # Publish() returns before this first step runs (lock held)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._ready_to_send(mine), 0.5)
                if self._call is not mine:
                    return
                if self._closed:  # say goodbye: the daemon clears our GPU tier at once
                    departing = events_pb2.EventBatch(engine_id=self.engine_id,
                                                      incarnation=self.incarnation, departing=True)
                    break
                batch = self._pending.get(self._send_from)
                if batch is None:
                    continue
                self._send_from += 1
            yield batch
        yield departing

    def _ready_to_send(self, mine: Any) -> bool:
        return self._closed or self._call is not mine or self._send_from in self._pending

    def _on_ack(self, ack: log_pb2.PublishAck) -> None:
        reset_why = ""
        with self._cond:
            if ack.incarnation != self.incarnation:
                return  # an answer about a batch from before a reset
            if ack.log_epoch and self.log_epoch and ack.log_epoch != self.log_epoch:
                reset_why = f"log epoch changed from {self.log_epoch} to {ack.log_epoch}: the log was lost"
            elif ack.status == _RESEND and ack.resend_from <= self._acked:
                # Batches the daemon acked are gone from its log (and we dropped them): no
                # resend can fill that gap, so start over instead of resending forever.
                reset_why = f"daemon asks to resend acked batches from {ack.resend_from}: the log lost them"
            elif ack.status == _RESEND and ack.resend_from >= ack.seq:
                # Not a gap (that asks for seqs before the one answered): the daemon will not
                # take this incarnation from here (it took the engine for departed, or its
                # incarnation reused), and resending the same batch would be asked again forever.
                reset_why = f"daemon asks to resend batch {ack.seq} itself: {ack.message}"
            elif ack.status == _REJECTED:
                reset_why = f"batch {ack.seq} rejected: {ack.message}"
            elif ack.acked_seq >= self._next_seq:
                # The daemon holds seqs of this incarnation we never sent: another life of this
                # engine used the same incarnation. Continuing would drop our batches as
                # duplicates, so start over under a new one.
                reset_why = f"daemon acked seq {ack.acked_seq} beyond ours: incarnation reused"
            else:
                self._acked = max(self._acked, ack.acked_seq)
                while self._pending and next(iter(self._pending)) <= self._acked:
                    self._pending.popitem(last=False)
                self._send_from = max(self._send_from, self._acked + 1)
                if ack.status == _RESEND and ack.seq >= self._rewind_mark:
                    # Batches sent before this rewind all answer RESEND too: ignore those.
                    self._rewind_mark = self._send_from
                    self._send_from = max(ack.resend_from, self._acked + 1)
            if ack.log_epoch:
                self.log_epoch = ack.log_epoch
            self._cond.notify_all()
        if reset_why:
            self._reset(reset_why)
