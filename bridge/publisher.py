"""kv-bridge core: tails the log and republishes it in the vLLM ZMQ wire format (WIRE.md).

One published batch per log record. Seqs are numbered per published stream (the mixed stream,
or one source's stream in per-source mode) by :class:`bridge.seqindex.SeqIndex`, derived from
the log itself at start: in the mixed stream seq = offset - 1 as long as no record is empty
(an empty record takes no seq, because the wire never carries an empty batch). A restarted
bridge resumes after the last offset it saved (bridge.position), so subscribers see the
sequence continue; after a SIGKILL the few batches published since the last save are sent
again with the same seqs, which subscribers drop as duplicates.

The log has an epoch (DESIGN 3.5), checked after every read and every ``epoch_check_s`` when
idle: when Redis lost the log and the daemon started a new one, the bridge publishes the signal
of bridge.epoch and then the new log from offset 1, seqs continuing; ``/healthz`` says
re-syncing meanwhile.

The daemon trims the log behind its checkpoints (DESIGN 3.5): on a trimmed log the state starts
from the newest usable checkpoint at or before the bridge's position, plus the records after it
(bridge.bootstrap, bridge.state). A position before the oldest retained record jumps to the
newest checkpoint (the mixed stream's seq stays offset - 1, so subscribers see the jump and
re-bootstrap by snapshot); a position inside the retained log but before every checkpoint keeps
publishing from there and takes the checkpoint's state when publishing reaches its offset
(snapshot requests wait for that). A bridge that falls behind the trim while running does the
same from the oldest record it finds.

Publishing transcodes the stored record straight into the wire layout (bridge.transcode);
the state, needed only for snapshots, is applied in idle time (bridge.state).

Threads: the caller's thread runs :meth:`Bridge.run` (read, publish, apply) and owns the PUB
socket; a :class:`bridge.replay_server.ReplayServer` thread owns the ROUTER socket and reads the
log itself. ``_lock`` guards the state and the seq indexes they share.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import zmq
from prometheus_client import Counter

from bridge.bootstrap import CheckpointReader
from bridge.config import BridgeConfig
from bridge.epoch import EpochWatch, Preamble, clear_batches
from bridge.errors import ForeignEntry
from bridge.legacy_mirror import LegacyMirror
from bridge.metrics import BridgeMetrics, Health
from bridge.position import PositionStore, SavedPosition
from bridge.replay_server import ReplayPlan, ReplayServer, SnapshotPlan
from bridge.seqindex import SeqIndex
from bridge.state import LazyState
from bridge.transcode import Transcoded, batch_for, is_foreign, takes_seq
from events.logreader import LogReader, LogUnavailable, RawEntry
from events.schema import SchemaError
from events.state_gc import GcPolicy

log = logging.getLogger("kvbridge")

CATCH_UP_SLICE_S = 0.002
"""Idle time goes to the state in slices this long; new records are read between them."""


class PublishedStream:
    """One topic with its own contiguous seq; ``source`` None publishes every source."""

    def __init__(self, topic: str, source: str | None) -> None:
        self.topic = topic
        self.topic_bytes = topic.encode()
        self.source = source
        self.index = SeqIndex()
        self.preamble: Preamble = ()  # the clear batches that opened the current epoch

    def wants(self, batch: Transcoded | None) -> bool:
        return takes_seq(batch, self.source)


@dataclass(frozen=True)
class Endpoints:
    pub: str
    replay: str


class Bridge:
    def __init__(
        self,
        config: BridgeConfig,
        reader: LogReader,
        positions: PositionStore,
        ctx: zmq.Context[zmq.Socket[bytes]],
        metrics: BridgeMetrics | None = None,
        health: Health | None = None,
        checkpoints: CheckpointReader | None = None,
    ) -> None:
        self.config = config
        self._checkpoints = checkpoints
        self._reader = reader
        self._positions = positions
        self.metrics = metrics or BridgeMetrics()
        self.health = health or Health()
        self._lock = threading.Lock()
        self._state = LazyState(self.metrics, config.max_pending)
        self._gc = GcPolicy(config.full_gc_interval_s)
        self._streams: dict[str, PublishedStream] = {}
        self._position = 0  # last log offset published (its apply may still be pending)
        self._held_at = 0  # a foreign log entry the bridge waits before (0: none)
        self._events_in_chunk = 0
        self._saved_position = -1
        self._last_save = 0.0
        self._started = False
        self._epochs = EpochWatch(positions.log_epoch, reader.head, self.health, config.epoch_check_s)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self._pub.bind(config.pub_endpoint)
        self._replay = ReplayServer(ctx, config, reader, self, self.metrics)
        # --legacy-pub: every batch also goes out in the legacy layout (bridge.legacy_mirror)
        self._legacy = LegacyMirror(ctx, config, reader, self, self.metrics) if config.legacy_pub_endpoint else None
        # The daemon trims the log behind its checkpoints (offloadd.log.checkpoint): a bridge
        # that fell behind the horizon skips what is gone, counted here (and logged).
        self.gap_records = Counter(
            "kvbridge_log_gap_records", "Records trimmed from the log before the bridge read them",
            registry=self.metrics.registry,
        )
        if config.source is not None:
            self._stream_for(config.source)
        elif not config.per_source:
            self._streams[config.topic] = PublishedStream(config.topic, None)

    @property
    def endpoints(self) -> Endpoints:
        pub = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        return Endpoints(pub, self._replay.endpoint)

    @property
    def position(self) -> int:
        return self._position

    # -- main loop ---------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Publish until ``stop`` is set; Redis outages are retried with backoff, never fatal."""
        backoff = 0.1
        try:
            while not stop.is_set():
                try:
                    if not self._started:
                        self._start()
                    self._step()
                    backoff = 0.1
                except LogUnavailable as exc:
                    self.metrics.redis_errors.inc()
                    self.metrics.redis_up.set(0)
                    self.health.set(redis_ok=False, detail=str(exc))
                    log.warning("redis unavailable (%s); retrying in %.1fs", exc, backoff)
                    stop.wait(backoff)
                    backoff = min(backoff * 2, 2.0)
        finally:
            self.close()

    def close(self) -> None:
        self._replay.stop()
        if self._legacy is not None:  # legacy mirror
            self._legacy.stop()
        if self._started:
            try:
                self._save(force=True)
            except LogUnavailable as exc:
                log.warning("could not save the position on stop: %s", exc)
        self._pub.close()

    def _start(self) -> None:
        """Rebuild state and seq indexes from the log up to where publishing resumes."""
        saved = self._positions.load()
        epoch = self._positions.log_epoch()
        carried: dict[str, int] | None = None
        if saved is not None and saved.epoch and epoch is not None and saved.epoch != epoch:
            log.warning("saved position is of log epoch %s, the log is now epoch %s: the log was "
                        "replaced; publishing it from offset 1, seqs continuing", saved.epoch, epoch)
            carried, saved = saved.next_seqs, None
        head, first = self._reader.head(), self._reader.first_offset()
        if saved is not None and saved.offset > head:
            log.warning("saved position %d is beyond the log head %d (log reset?); starting at the head",
                        saved.offset, head)
            saved = None
        if self.config.start == "beginning":
            resume = max(0, first - 1)  # the oldest retained record on
        elif self.config.start == "resume" and saved is not None:
            resume = saved.offset
        else:
            resume = head
        if carried is not None:
            resume = 0
        with self._lock:
            self._state.reset()
            for stream in self._streams.values():
                stream.index = SeqIndex()
            self._position = 0
            jumped, applied = False, 0
            if first > 1:
                resume, applied = self._bootstrap(resume, first, epoch)
                jumped = applied == resume and saved is not None and saved.offset < first - 1
            entries = self._reader.iter_range_raw(1, resume, self.config.read_chunk)
            for n, entry in enumerate(entries):
                if entry[0] > applied:
                    self._state.apply_entry(entry)
                self._index(entry[0], batch_for(entry[1], self.config.layout))
                self._position = entry[0]
                if n % 1000 == 999:
                    self._gc.after_chunk()
            self._gc.after_chunk()
            self._position = max(resume, self._position)
            self._rebase(saved, first, epoch, jumped)
        self._epochs.epoch = epoch
        self._started = True
        self.metrics.redis_up.set(1)
        self.health.set(redis_ok=True, detail=f"publishing after offset {self._position}", ready=True)
        if carried is not None:
            self._open_epoch(epoch or "", carried)
        self._replay.start()
        if self._legacy is not None:  # legacy mirror
            self._legacy.start()
        log.info("kv-bridge ready: pub=%s replay=%s topic=%s layout=%s resume_after=%d head=%d",
                 self.endpoints.pub, self.endpoints.replay, self.config.topic, self.config.layout,
                 self._position, head)

    def _bootstrap(self, resume: int, first: int, epoch: str | None) -> tuple[int, int]:
        """The state on a log trimmed before ``first`` (module docstring): (the position to
        resume after, the offset through which the state already holds the records)."""
        found = self._checkpoints.usable(epoch, first) if self._checkpoints is not None else []
        at_or_before = [c for c in found if c[0].offset <= resume]
        for manifest, snap in at_or_before or found:
            try:
                if manifest.offset <= resume:
                    self._state.start_from(snap)
                elif resume < first - 1:
                    log.warning("position %d is before the oldest retained record %d: jumping to the "
                                "checkpoint at offset %d", resume, first, manifest.offset)
                    self._state.start_from(snap)
                    resume = manifest.offset
                else:
                    self._state.defer_to(snap)
            except SchemaError as exc:
                log.error("checkpoint %s holds an invalid event (%s); trying an older one",
                          manifest.ckpt_id, exc)
                continue
            log.info("state from checkpoint %s at offset %d", manifest.ckpt_id, manifest.offset)
            return resume, manifest.offset
        log.error("the log starts at offset %d and no usable checkpoint covers the records before "
                  "it: snapshots miss the blocks stored before it", first)
        return resume, 0

    def _rebase(self, saved: SavedPosition | None, first: int, epoch: str | None, jumped: bool) -> None:
        """After trimming, old records are gone: continue the saved numbering instead (the mixed
        stream keeps seq = offset - 1 when the position ``jumped`` over trimmed records). After
        an epoch change the numbering starts at the saved base of the epoch."""
        if first <= 1:
            if saved is not None and saved.epoch and saved.epoch == epoch:
                for topic, stream in self._streams.items():
                    if saved.base_seqs.get(topic):
                        stream.index.rebase(saved.base_seqs[topic])
            return
        for topic, stream in self._streams.items():
            if jumped and stream.source is None:
                stream.index.rebase(first - 1)
            elif saved is not None and topic in saved.next_seqs:
                stream.index.rebase(max(0, saved.next_seqs[topic] - len(stream.index)))
            elif stream.source is None:
                stream.index.rebase(first - 1)

    def _step(self) -> None:
        epochs = self._epochs
        if epochs.is_gone and not self._check_epoch(moved_back=False):
            time.sleep(self.config.poll_block_ms / 1000)
            return
        # With applies pending, only peek for new records: idle time goes to the state.
        block_ms = 0 if self._state.pending else self.config.poll_block_ms
        records = self._reader.poll_raw(self._position, block_ms, self.config.read_chunk)
        # Read after the records: if the epoch is still ours now, they were ours.
        if (records or epochs.is_due()) and not self._check_epoch(moved_back=not records):
            return
        self.health.set(redis_ok=True, detail=epochs.detail or f"publishing after offset {self._position}")
        self.metrics.redis_up.set(1)
        if records:
            published = 0
            self._events_in_chunk = 0
            foreign = None
            with self._lock:
                for i, record in enumerate(records):
                    try:
                        published += self._publish(record)
                    except ForeignEntry as exc:
                        foreign, records = exc.offset, records[:i]
                        break
            if records:
                self._count(records, published)
                epochs.published(self._position)
            if foreign is not None:
                self._hold(foreign)
                return
            if self._held_at:
                log.info("log entry %d is a record again: publishing", self._held_at)
                self._held_at = 0
                self.health.set(redis_ok=True, detail=f"publishing after offset {self._position}",
                                ready=True)
        elif self._state.pending:
            with self._lock:
                # Short slices: a record that arrives meanwhile waits at most about one.
                self._state.catch_up(budget_s=CATCH_UP_SLICE_S)
        self._gc.after_chunk()
        self._save(force=False)

    def _hold(self, offset: int) -> None:
        """Stay before a foreign entry: never publish past it, never skip it (the daemon's real
        record takes that offset once ``kvctl repair --drop-foreign`` removed it)."""
        if self._held_at != offset:
            log.error("log entry %d is not a record the daemon wrote: holding at offset %d; "
                      "inspect with 'kvctl verify', remove it with 'kvctl repair --drop-foreign'",
                      offset, self._position)
            self._held_at = offset
        self.health.set(redis_ok=True, ready=False,
                        detail=f"held before foreign log entry {offset}: run kvctl repair --drop-foreign")
        time.sleep(self.config.poll_block_ms / 1000)

    def _check_epoch(self, moved_back: bool) -> bool:
        """True when the log is still the one being published; a new one is opened."""
        new = self._epochs.check(self._position, moved_back)
        if new is not None:
            self._open_epoch(new, None)
        return new is None and not self._epochs.is_gone

    def _open_epoch(self, epoch: str, carried: dict[str, int] | None) -> None:
        """Publish the clear batches (bridge.epoch) and restart from offset 1; seqs continue
        (from ``carried``, the saved next seqs, at start)."""
        with self._lock:
            known = self._state.sources()
            for stream in self._streams.values():
                if carried is not None and stream.topic not in carried:
                    continue
                first = carried[stream.topic] if carried is not None else stream.index.next_seq
                sources = [stream.source] if stream.source is not None else known
                stream.preamble = clear_batches(sources, first, self.config.layout)
                stream.index = SeqIndex(first + len(stream.preamble))
                for seq, payload in stream.preamble:
                    self._pub.send_multipart([stream.topic_bytes, seq.to_bytes(8, "big"), payload])
                    if self._legacy is not None:  # legacy mirror
                        self._legacy.publish_payload(stream.topic_bytes, seq, payload)
            self._state.reset()
            self._position = 0
        self._epochs.opened(epoch)
        self._saved_position = -1
        self._save(force=True)

    def _count(self, entries: list[RawEntry], published: int) -> None:
        """Metrics once per chunk: per-record label lookups cost as much as the publishing."""
        m = self.metrics
        m.records_read.inc(len(entries))
        m.offset.set(self._position)
        m.head.set(entries[-1][0])
        m.pending.set(self._state.pending)
        for stream in self._streams.values():
            m.next_seq.labels(stream.topic).set(stream.index.next_seq)
        m.published_events.inc(self._events_in_chunk)
        topic = next(iter(self._streams)) if len(self._streams) == 1 else "*"
        m.published_batches.labels(topic).inc(published)

    def _publish(self, entry: RawEntry) -> int:
        """Publish one record on its stream (1 when published); its apply is queued.
        ForeignEntry, and nothing changed, for an entry the daemon did not write."""
        offset, data = entry
        batch = batch_for(data, self.config.layout)
        if batch is None and is_foreign(offset, data):
            raise ForeignEntry(offset)
        if offset != self._position + 1 and self._position:
            self._skip(offset)
        self._state.add(entry)
        stream = self._index(offset, batch)
        self._position = offset
        if stream is None or batch is None:
            return 0
        self._events_in_chunk += batch.num_events
        seq = stream.index.next_seq - 1
        pub = self._pub
        pub.send(stream.topic_bytes, zmq.SNDMORE)
        pub.send(seq.to_bytes(8, "big"), zmq.SNDMORE)
        pub.send(batch.payload)
        if self._legacy is not None:  # legacy mirror
            self._legacy.publish(stream.topic_bytes, seq, data)
        return 1

    def _skip(self, offset: int) -> None:
        """Records up to ``offset`` - 1 were trimmed before they were read: say so, and let the
        mixed stream's seqs jump with the offsets (seq = offset - 1 stays), so subscribers see
        the gap. A per-source stream cannot know how many of them were its own: it does not."""
        skipped = max(0, offset - self._position - 1)
        log.warning("log gap: offsets jump from %d to %d (trimmed before they were read); "
                    "continuing from the oldest retained record", self._position, offset)
        self.gap_records.inc(skipped)
        self._rebootstrap(offset)
        for stream in self._streams.values():
            if stream.source is None:  # everything before the gap left the log: shifting is safe
                stream.index.rebase(stream.index.base_seq + skipped)

    def _rebootstrap(self, first: int) -> None:
        """After a gap the state misses the trimmed records: it is the newest usable checkpoint's
        once publishing reaches it (its offset is at least ``first`` - 1: the log holds its tail)."""
        found = self._checkpoints.usable(self._epochs.epoch, first) if self._checkpoints is not None else []
        for manifest, snap in found:
            try:
                self._state.defer_to(snap)
            except SchemaError as exc:
                log.error("checkpoint %s holds an invalid event (%s)", manifest.ckpt_id, exc)
                continue
            log.info("state from checkpoint %s at offset %d after the gap", manifest.ckpt_id, manifest.offset)
            return
        log.error("no usable checkpoint covers the records trimmed before offset %d: snapshots miss "
                  "the blocks stored before it", first)

    def _index(self, offset: int, batch: Transcoded | None) -> PublishedStream | None:
        """Give the record its seq on the stream that publishes it (if any)."""
        if batch is None:
            log.error("log entry %d cannot be decoded; it is not published", offset)
            return None
        stream = self._stream_for(batch.source)
        if stream is None or not stream.wants(batch):
            return None
        stream.index.append(offset)
        return stream

    def _stream_for(self, source: str) -> PublishedStream | None:
        if self.config.per_source or self.config.source == source:
            topic = self.config.topic_for(source)
            stream = self._streams.get(topic)
            if stream is None:
                stream = self._streams[topic] = PublishedStream(topic, source)
            return stream
        if self.config.source is not None:
            return None
        return self._streams[self.config.topic]

    def _save(self, force: bool) -> None:
        now = time.monotonic()
        if self._position == self._saved_position:
            return
        if not force and now - self._last_save < self.config.save_interval_s:
            return
        with self._lock:
            position = SavedPosition(
                self._position, {t: s.index.next_seq for t, s in self._streams.items()},
                self._epochs.epoch or "", {t: s.index.base_seq for t, s in self._streams.items()},
            )
        self._positions.save(position)
        self._saved_position = position.offset
        self._last_save = now

    # -- what the replay thread asks (under the lock) ----------------------------------------

    def replay_plan(self, topic: bytes | None, start_seq: int) -> ReplayPlan | None:
        with self._lock:
            stream = self._stream_by_topic(topic)
            if stream is None:
                return None
            index = stream.index
            first_seq = max(start_seq, index.base_seq)
            # A seq from before an epoch change: the clear batches first, so the jump shows.
            preamble = tuple(p for p in stream.preamble if p[0] >= start_seq)
            if first_seq >= index.next_seq:
                return ReplayPlan(stream.topic_bytes, stream.source, first_seq, 0, -1, preamble)
            return ReplayPlan(
                stream.topic_bytes, stream.source, first_seq, index.offset_of(first_seq),
                index.last_offset, preamble,
            )

    def seq_from(self, topic: bytes, offset: int) -> int:
        """The seq of the first record at or after ``offset`` on ``topic``'s stream."""
        with self._lock:
            stream = self._stream_by_topic(topic)
            if stream is None:
                return 0
            return stream.index.base_seq + stream.index.count_through(offset - 1)

    def snapshot_plan(self, topic: bytes | None) -> SnapshotPlan | None:
        """The state and the seq after it; waits (up to the replay send timeout) while the state
        waits for a checkpoint's offset (bridge.state)."""
        deadline = time.monotonic() + self.config.replay_send_timeout_s
        while True:
            with self._lock:
                self._state.catch_up()
                if self._state.is_ready or time.monotonic() > deadline:
                    return self._snapshot_plan(topic)
            time.sleep(0.01)

    def _snapshot_plan(self, topic: bytes | None) -> SnapshotPlan | None:
        if not self._state.is_ready:
            log.warning("snapshot requested before the state reached its checkpoint: it is incomplete")
        stream = self._stream_by_topic(topic)
        if stream is None:
            return None
        snap = self._state.export()
        parts = tuple(
            (s.source, s.events)
            for s in snap.sources
            if s.events and (stream.source is None or s.source == stream.source)
        )
        return SnapshotPlan(stream.topic_bytes, parts, stream.index.next_seq)

    def _stream_by_topic(self, topic: bytes | None) -> PublishedStream | None:
        if topic is None:
            # A plain request names no topic: fine with one fixed stream; with --per-source the
            # streams come and go with the sources, so the topic frame is required.
            return None if self.config.per_source else next(iter(self._streams.values()))
        return self._streams.get(topic.decode(errors="replace"))
