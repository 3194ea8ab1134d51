"""A KV-event subscriber for router authors: bootstrap, follow, fill gaps, answer prefix queries.

    sub = KvEventSubscriber("tcp://bridge:5557", "tcp://bridge:5558")
    sub.bootstrap()                      # snapshot: the full current state + the seq to go on from
    while serving:
        sub.poll(100)                    # live batches; a seq gap is filled by a replay request
        sub.longest_prefix(prompt_ids, BlockHasher(block_size=16),     # vLLM's default seed
                           keys=RequestKeys(cache_salt="tenant-a"))    # the request's extra keys

Topics: without ``topic`` the subscriber takes both the bridge's default topic ``kv-events`` and
vLLM's default ``""`` (a vLLM engine's own publisher, or a bridge started with ``--topic ""``);
messages of other topics are counted (``stats.other_topics``) and dropped.

State is a :class:`events.state.CacheState`, fed records rebuilt from the wire with incarnation 0
(unfenced: the bridge already fenced them). Each event's source is its ``source`` key (our
extension of the map layout) or, for streams without it (vLLM engines, the legacy layout,
per-source topics), ``default_source`` (the topic when not given).

When the log is replaced (a new log epoch, bridge.epoch) the bridge publishes, seqs continuing,
an ``AllBlocksCleared`` without medium per source: the reducer drops every tier of that source,
so the state follows the new log with nothing to do here.

Threads: the sockets belong to the thread that calls :meth:`bootstrap`/:meth:`poll`;
:meth:`longest_prefix` and :meth:`view` may be called from other threads (they take ``lock``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from events.codec_vllm import WireBatch, decode_batch
from events.extra_keys import RequestKeys
from events.hashing import BlockHasher, to_wire
from events.replay_socket import EndpointError, ReplaySocket, SubscriberError, connect
from events.schema import (
    BlockDigest,
    BlockHash,
    BlockStored,
    Event,
    LogRecord,
    Medium,
    SchemaError,
)
from events.state import CacheState, PrefixMatch, Snapshot, SourceSnapshot
from events.wire_frames import SNAPSHOT, seq_bytes

log = logging.getLogger("kvsubscriber")

DEFAULT_TOPIC = "kv-events"
"""kv-bridge's default topic; vLLM's publishers default to ``""``. Subscribers take both."""


@dataclass
class SubscriberStats:
    batches: int = 0
    duplicates: int = 0
    gaps: int = 0
    replayed: int = 0
    lost: int = 0  # seqs no replay could supply (trimmed from the log)
    malformed: int = 0
    other_topics: int = 0  # messages of a topic this subscriber does not follow


class KvEventSubscriber:
    def __init__(
        self,
        pub_endpoint: str,
        replay_endpoint: str,
        topic: str | None = None,
        *,
        default_source: str | None = None,
        replay_timeout_s: float = 10.0,
        idle_sync_s: float | None = 2.0,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        # None: the bridge's default topic and vLLM's "" (module docstring).
        self.topics = (DEFAULT_TOPIC.encode(), b"") if topic is None else (topic.encode(),)
        self.topic = self.topics[0]
        self.default_source = default_source if default_source is not None else self.topic.decode()
        # PUB/SUB shows a loss only when a later message arrives; when the stream goes quiet
        # (say, right after a bridge restart) we ask the replay socket whether we missed any.
        self.idle_sync_s = idle_sync_s
        self._last_activity = time.monotonic()
        self._own_ctx = ctx is None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = ctx or zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)  # never drop on our side; gaps are the PUB's doing
        for prefix in {b"" if b"" in self.topics else t for t in self.topics}:
            self._sub.setsockopt(zmq.SUBSCRIBE, prefix)
        try:
            connect(self._sub, pub_endpoint)
            self._replay = ReplaySocket(self._ctx, replay_endpoint, replay_timeout_s)
        except EndpointError:
            self._sub.close(linger=0)
            if self._own_ctx:
                self._ctx.term()
            raise
        self.lock = threading.RLock()
        self.state = CacheState()
        self.next_seq: int | None = None  # None: not yet bootstrapped nor following
        self.stats = SubscriberStats()
        self.last_ts = 0.0
        self._on_batch: Callable[[int, WireBatch], None] | None = None

    def on_batch(self, callback: Callable[[int, WireBatch], None] | None) -> None:
        """Call ``callback(seq, batch)`` for every batch applied from the stream (not snapshots)."""
        self._on_batch = callback

    # -- bootstrap ---------------------------------------------------------------------------

    def bootstrap(self) -> int:
        """Load the full current state by snapshot; return the seq the stream continues from."""
        frames_list, end = self._replay.request(SNAPSHOT)
        by_source: dict[str, list[BlockStored]] = {}
        for _topic, _seq, payload in frames_list:
            batch = self._decode(payload)
            if batch is None:
                continue
            for event, src in zip(batch.events, batch.sources, strict=True):
                if isinstance(event, BlockStored):
                    by_source.setdefault(src or self.default_source, []).append(event)
        if len(end) != 8:
            raise SubscriberError(f"snapshot end marker has a {len(end)}-byte seq frame")
        next_seq = int.from_bytes(end, "big")
        snap = Snapshot(0, tuple(SourceSnapshot(s, 0, 0, tuple(ev)) for s, ev in by_source.items()))
        with self.lock:
            self.state = CacheState.from_snapshot(snap)
            self.next_seq = next_seq
        return next_seq

    def replay_from(self, seq: int) -> int:
        """Apply every batch the bridge still has from ``seq`` on; return how many were applied."""
        frames_list, _end = self._replay.request(seq_bytes(seq))
        if self.next_seq is None:
            self.next_seq = seq
        applied = 0
        for _topic, seq_frame, payload in frames_list:
            got = int.from_bytes(seq_frame, "big")
            if got < self.next_seq:
                continue
            if got > self.next_seq:  # older batches are no longer in the log
                self.stats.lost += got - self.next_seq
                log.warning("replay starts at seq %d, wanted %d: lost from the log", got, self.next_seq)
            self._apply(got, payload)
            applied += 1
        self.stats.replayed += applied
        return applied

    # -- live --------------------------------------------------------------------------------

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply the live batches that arrive within ``timeout_ms``; return how many."""
        applied = 0
        if not self._sub.poll(timeout_ms, zmq.POLLIN):
            idle = time.monotonic() - self._last_activity
            if self.idle_sync_s is not None and self.next_seq is not None and idle > self.idle_sync_s:
                applied = self.catch_up()
            return applied
        self._last_activity = time.monotonic()
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return applied
            applied += self._handle_live(frames)

    def catch_up(self) -> int:
        """Replay whatever the bridge published after our last batch; return how many."""
        self._last_activity = time.monotonic()
        if self.next_seq is None:
            return 0
        try:
            return self.replay_from(self.next_seq)
        except SubscriberError as exc:
            log.warning("catch-up failed: %s", exc)
            return 0

    def run_until(
        self, predicate: Callable[[KvEventSubscriber], bool], timeout_s: float = 10.0
    ) -> bool:
        """Poll until ``predicate(self)`` holds; False when ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while not predicate(self):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.poll(int(min(left, 0.05) * 1000) + 1)
        return True

    def _handle_live(self, frames: list[bytes]) -> int:
        if len(frames) == 3 and frames[0] not in self.topics:
            self.stats.other_topics += 1  # the SUB prefix "" takes every topic
            return 0
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.malformed += 1
            return 0
        seq = int.from_bytes(frames[1], "big")
        if self.next_seq is None:
            self.next_seq = seq  # following live without a bootstrap: start here
        if seq < self.next_seq:
            self.stats.duplicates += 1
            return 0
        if seq > self.next_seq:
            self.stats.gaps += 1
            log.info("gap: got seq %d, expected %d; replaying", seq, self.next_seq)
            try:
                self.replay_from(self.next_seq)
            except SubscriberError as exc:
                log.warning("gap fill failed: %s", exc)
            if seq < self.next_seq:
                return 0
            if seq > self.next_seq:
                self.stats.lost += seq - self.next_seq
        self._apply(seq, frames[2])
        return 1

    def _apply(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1
        batch = self._decode(payload)
        if batch is None:
            return
        with self.lock:
            for source, events in _split_by_source(batch, self.default_source):
                offset = self.state.offset + 1
                self.state.apply(LogRecord(offset, source, 0, 0, batch.ts, tuple(events)))
        self.stats.batches += 1
        self.last_ts = batch.ts
        if self._on_batch is not None:
            self._on_batch(seq, batch)

    def _decode(self, payload: bytes) -> WireBatch | None:
        try:
            return decode_batch(payload)
        except SchemaError as exc:
            self.stats.malformed += 1
            log.warning("dropping a malformed batch: %s", exc)
            return None

    # -- queries -----------------------------------------------------------------------------

    def longest_prefix(
        self,
        token_ids: Sequence[int],
        hasher: BlockHasher,
        group_idx: int = 0,
        extra_keys: Sequence[Any] | None = None,
        keys: RequestKeys | None = None,
    ) -> dict[str, PrefixMatch]:
        """Per source, how many leading full blocks of ``token_ids`` are cached, and where.

        ``keys`` are the request's extra keys as vLLM places them per block (LoRA, cache salt,
        multimodal items); ``extra_keys``, the older form, mixes one tuple into every block."""
        if keys is not None and extra_keys is not None:
            raise ValueError("give keys or extra_keys, not both")
        if extra_keys is not None:
            keys = RequestKeys(fixed=tuple(extra_keys))
        digests: list[BlockDigest] = hasher.hash_request(token_ids, keys)
        hashes: list[BlockHash] = [to_wire(d) for d in digests]
        with self.lock:
            return self.state.longest_prefix(hashes, group_idx)

    def view(self) -> dict[tuple[str, Medium, int], frozenset[int]]:
        with self.lock:
            return self.state.view()

    def close(self) -> None:
        self._sub.close(linger=0)
        self._replay.close()
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> KvEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _split_by_source(batch: WireBatch, default: str) -> list[tuple[str, list[Event]]]:
    """Consecutive events of one source form one record (a bridge batch has one source)."""
    out: list[tuple[str, list[Event]]] = []
    for event, src in zip(batch.events, batch.sources, strict=True):
        source = src or default
        if out and out[-1][0] == source:
            out[-1][1].append(event)
        else:
            out.append((source, [event]))
    return out
