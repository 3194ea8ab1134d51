"""kv-bridge core: tails the log and republishes it in the vLLM ZMQ wire format (WIRE.md).

One published batch per log record. Seqs are numbered per published stream (the mixed stream,
or one source's stream in per-source mode: bridge.streams) by :class:`bridge.seqindex.SeqIndex`, derived from
the log itself at start: in the mixed stream seq = offset - 1 as long as no record is empty
(an empty record takes no seq, because the wire never carries an empty batch). A restarted
bridge resumes after the last offset it saved (bridge.position), so subscribers see the
sequence continue; after a SIGKILL the few batches published since the last save are sent
again with the same seqs, which subscribers drop as duplicates.

The log has an epoch (DESIGN 3.5), checked after every read and every ``epoch_check_s`` when
idle: when Redis lost the log and the daemon started a new one, the bridge publishes the signal
of bridge.epoch and then the new log from offset 1, seqs continuing; ``/healthz`` says
re-syncing meanwhile. A log with the same epoch that does not continue what was published (a
failover to a replica that had not synced) is found by reading on from the record published last
(bridge.tip) and published again the same way.

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
log itself (the pair: bridge.outlet). ``_lock`` guards the state and the seq indexes they share.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq
from prometheus_client import Counter

from bridge.bootstrap import CheckpointReader, defer_state, start_state
from bridge.config import BridgeConfig
from bridge.epoch import EpochWatch
from bridge.errors import ForeignEntry
from bridge.legacy_mirror import LegacyMirror
from bridge.metrics import BridgeMetrics, Health
from bridge.outlet import Endpoints, Outlet
from bridge.position import PositionStore, SavedPosition, resume_point
from bridge.replay_server import ReplayPlan, SnapshotPlan
from bridge.state import LazyState
from bridge.streams import Streams
from bridge.tip import TipReader
from bridge.transcode import batch_for, is_foreign, publish_decoded
from events.logreader import LogReader, LogUnavailable, RawEntry
from events.state_gc import GcPolicy

log = logging.getLogger("kvbridge")

CATCH_UP_SLICE_S = 0.002
"""Idle time goes to the state in slices this long; new records are read between them."""


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
        self._streams = Streams(config)
        self._position = 0  # last log offset published (its apply may still be pending)
        self._tip: bytes | None = None  # the record at _position as read (None: not known)
        self._tail = TipReader(reader, config.read_chunk, positions.epoch_key)
        self._held_at = 0  # a foreign log entry the bridge waits before (0: none)
        self._events_in_chunk = 0
        self._saved_position = -1
        self._last_save = 0.0
        self._started = False
        self._epochs = EpochWatch(positions.log_epoch, reader.head, self.health, config.epoch_check_s)
        self._outlet = Outlet(ctx, config, reader, self, self.metrics, layout=config.layout,
                              pub_endpoint=config.pub_endpoint, replay_endpoint=config.replay_endpoint)
        # --legacy-pub: every batch also goes out in the legacy layout (bridge.legacy_mirror)
        self._legacy = LegacyMirror(ctx, config, reader, self, self.metrics) if config.legacy_pub_endpoint else None
        # The daemon trims the log behind its checkpoints (offloadd.log.checkpoint): a bridge
        # that fell behind the horizon skips what is gone, counted here (and logged).
        self.gap_records = Counter(
            "kvbridge_log_gap_records", "Records trimmed from the log before the bridge read them",
            registry=self.metrics.registry,
        )
        # A log that went back under the same epoch (bridge.tip), published again.
        self.rewinds = Counter(
            "kvbridge_log_rewinds", "Times the log no longer held the record published last (same "
            "epoch; a failover to a replica that had not synced)", registry=self.metrics.registry,
        )

    @property
    def endpoints(self) -> Endpoints:
        return self._outlet.endpoints

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
        self._outlet.stop()
        if self._legacy is not None:  # legacy mirror
            self._legacy.stop()
        if self._started:
            try:
                self._save(force=True)
            except LogUnavailable as exc:
                log.warning("could not save the position on stop: %s", exc)

    def _start(self) -> None:
        """Rebuild state and seq indexes from the log up to where publishing resumes."""
        loaded, epoch = self._positions.load(), self._positions.log_epoch()
        head, first = self._reader.head(), self._reader.first_offset()
        point = resume_point(loaded, epoch, head, first, self.config.start)
        saved, carried, resume = point.saved, point.carried, point.after
        with self._lock:
            self._state.reset()
            self._streams.reset()
            self._position, self._tip = 0, None
            jumped, applied = False, 0
            if first > 1:
                resume, applied = start_state(self._checkpoints, self._state, epoch, resume, first)
                jumped = applied == resume and saved is not None and saved.offset < first - 1
            entries = self._reader.iter_range_raw(1, resume, self.config.read_chunk)
            for n, entry in enumerate(entries):
                if entry[0] > applied:
                    self._state.apply_entry(entry)
                self._streams.index(entry[0], batch_for(entry[1], self.config.layout))
                self._position, self._tip = entry
                if n % 1000 == 999:
                    self._gc.after_chunk()
            self._gc.after_chunk()
            if resume > self._position:  # jumped to a checkpoint past the records read
                self._position, self._tip = resume, None
            self._streams.rebase(saved, first, epoch, jumped)
        self._epochs.epoch = epoch
        self._started = True
        self.metrics.redis_up.set(1)
        self.health.set(redis_ok=True, detail=f"publishing after offset {self._position}", ready=True)
        if carried is not None:
            self._open_epoch(epoch or "", carried)
        self._outlet.start()
        if self._legacy is not None:  # legacy mirror
            self._legacy.start()
        log.info("kv-bridge ready: pub=%s replay=%s topic=%s layout=%s resume_after=%d head=%d",
                 self.endpoints.pub, self.endpoints.replay, self.config.topic, self.config.layout,
                 self._position, head)

    def _step(self) -> None:
        epochs = self._epochs
        if epochs.is_gone and not self._check_epoch(moved_back=False):
            time.sleep(self.config.poll_block_ms / 1000)
            return
        # With applies pending, only peek for new records: idle time goes to the state.
        block_ms = 0 if self._state.pending else self.config.poll_block_ms
        read = self._tail.read(self._position, self._tip, block_ms)
        if read.rewound:
            self._rewound()
            return
        records = read.entries
        # Read after the records: if the epoch is still ours now, they were ours.
        # (read with them when bridge.tip could: one round trip less per read)
        known = (read.epoch,) if records and read.epoch_read else None
        if (records or epochs.is_due()) and not self._check_epoch(moved_back=not records, read=known):
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
            if len(records) < self.config.read_chunk:
                # Caught up with the log (a short chunk): the state's slice now rather than
                # after a peek for records that are most likely not there (DECISIONS 72).
                with self._lock:
                    self._state.catch_up(budget_s=CATCH_UP_SLICE_S)
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

    def _check_epoch(self, moved_back: bool, read: tuple[str | None] | None = None) -> bool:
        """True when the log is still the one being published; a new one is opened. ``read``:
        the epoch as read after the records (EpochWatch.check)."""
        new = self._epochs.check(self._position, moved_back, read)
        if new is not None:
            self._open_epoch(new, None)
        return new is None and not self._epochs.is_gone

    def _rewound(self) -> None:
        """The record published last is not the log's any more, in the same epoch (bridge.tip):
        publish the log again as a new epoch's, after its clear batches."""
        if not self._check_epoch(moved_back=False):
            return  # another epoch (opened) or none (awaited): not a rewind
        log.warning("the log at offset %d is not the record published there (a failover to a "
                    "replica that had not synced?): telling subscribers (AllBlocksCleared) and "
                    "publishing the log again from its start, seqs continuing", self._position)
        self.rewinds.inc()
        self._open_epoch(self._epochs.epoch or "", None,
                         f"re-syncing: the log went back before offset {self._position} (failover)")

    def _open_epoch(self, epoch: str, carried: dict[str, int] | None, detail: str = "") -> None:
        """Publish the clear batches (bridge.epoch) and restart from offset 1; seqs continue
        (from ``carried``, the saved next seqs, at start)."""
        with self._lock:
            known = self._state.sources()
            for stream in self._streams.all():
                if carried is not None and stream.topic not in carried:
                    continue
                first = carried[stream.topic] if carried is not None else stream.index.next_seq
                for seq, payload in stream.open_epoch(first, known, self.config.layout):
                    self._outlet.send(stream.topic_bytes, seq, payload)
                    if self._legacy is not None:  # legacy mirror
                        self._legacy.publish_payload(stream.topic_bytes, seq, payload)
            self._state.reset()
            self._position, self._tip = 0, None
        self._epochs.opened(epoch, detail)
        self._saved_position = -1
        self._save(force=True)

    def _count(self, entries: list[RawEntry], published: int) -> None:
        """Metrics once per chunk: per-record label lookups cost as much as the publishing."""
        m = self.metrics
        m.records_read.inc(len(entries))
        m.offset.set(self._position)
        m.head.set(entries[-1][0])
        m.pending.set(self._state.pending)
        for stream in self._streams.all():
            m.next_seq.labels(stream.topic).set(stream.index.next_seq)
        m.published_events.inc(self._events_in_chunk)
        m.published_batches.labels(self._streams.metric_topic).inc(published)

    def _publish(self, entry: RawEntry) -> int:
        """Publish one record on its stream (1 when published); its apply is queued.
        ForeignEntry, and nothing changed, for an entry the daemon did not write."""
        offset, data = entry
        batch, record = publish_decoded(data, self.config.layout)
        if batch is None and is_foreign(offset, data):
            raise ForeignEntry(offset)
        if offset != self._position + 1:
            self._skip(offset)
        # Decoded once: the state takes the record (its stored bytes when not decoded here,
        # or when it names another offset, which the state's decode reports).
        self._state.add(record if record is not None and record.offset == offset else entry)
        stream = self._streams.index(offset, batch)
        self._position, self._tip = entry
        if stream is None or batch is None:
            return 0
        self._events_in_chunk += batch.num_events
        seq = stream.index.next_seq - 1
        self._outlet.send(stream.topic_bytes, seq, batch.payload)
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
        defer_state(self._checkpoints, self._state, self._epochs.epoch, offset)
        self._streams.skip(skipped)

    def _save(self, force: bool) -> None:
        now = time.monotonic()
        if self._position == self._saved_position:
            return
        if not force and now - self._last_save < self.config.save_interval_s:
            return
        with self._lock:
            position = SavedPosition(self._position, self._streams.next_seqs(),
                                     self._epochs.epoch or "", self._streams.base_seqs())
        self._positions.save(position)
        self._saved_position = position.offset
        self._last_save = now

    # -- what the replay thread asks (under the lock) ----------------------------------------

    def replay_plan(self, topic: bytes | None, start_seq: int) -> ReplayPlan | None:
        with self._lock:
            return self._streams.replay_plan(topic, start_seq)

    def seq_from(self, topic: bytes, offset: int) -> int:
        """The seq of the first record at or after ``offset`` on ``topic``'s stream."""
        with self._lock:
            return self._streams.seq_from(topic, offset)

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
        stream = self._streams.by_topic(topic)
        if stream is None:
            return None
        return stream.snapshot_plan(self._state.export())
