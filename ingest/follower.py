"""Follows one vLLM publisher: live batches from its PUB socket, gaps filled from its replay
socket, every batch appended to offloadd's log under the publisher's source.

Continuity. vLLM numbers batches from 0 per publisher life and keeps the last ~10,000 in a ring
that answers replay requests. The follower remembers a digest of each batch it applied lately
(ingest.life holds the life followed and applies its batches); before trusting a replay it asks from the last seq it applied (the anchor) and compares:

- the anchor comes back the same: the same life; what follows fills the gap;
- it comes back different, or the publisher has nothing that recent: the publisher restarted;
- the ring starts after the seq we need: the gap is lost.

A restart, a lost gap, a seq that goes back with other content, a new publisher identity or data
parallel rank, an undecodable batch and a publisher gone longer than its lease all end in a
**re-sync**: the source's current life ends (its stream says goodbye, the daemon clears the
source's tiers), a new incarnation starts and is rebuilt from the publisher's ring (what it still
holds, from its oldest batch) and what follows live. Blocks stored before the ring's oldest batch
are unknown then, so the log under-reports rather than claims blocks that may be gone.

Batches already waiting together (a burst, a replay) are handed to offloadd as one batch of
their events in order (ingest.sink bounds the size): one log record then holds several vLLM
batches.

Without a replay socket a gap or a restart re-syncs from what follows. A quiet publisher is
asked for what follows the anchor every ``idle_sync_s``: a lost last batch and a quiet restart
show up there too.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Final

import zmq
from zmq.utils.monitor import recv_monitor_message

from ingest.config import IngestConfig, VllmSource, source_name
from ingest.errors import Garbage
from ingest.life import SourceLife
from ingest.metrics import Health, IngestMetrics
from ingest.replay_client import ReplayClient, continuity
from ingest.wire import Frame, parse_live
from offloadd.client import ClientSecurity

log = logging.getLogger("kvingest")

_POLL_MS: Final = 50
_DRAIN: Final = 256  # live messages handled per poll


class Follower:
    def __init__(self, spec: VllmSource, config: IngestConfig, ctx: zmq.Context[zmq.Socket[bytes]],
                 security: ClientSecurity, metrics: IngestMetrics, health: Health) -> None:
        self.spec = spec
        self.config = config
        self.label = source_name(spec.name, spec.dp_rank)
        self._ctx = ctx
        self._metrics = metrics
        self._health = health
        self._topic = spec.topic.encode()
        self.life = SourceLife(spec.name, self.label, config, security, metrics, self._garbage)
        self._garbage_seen: set[str] = set()
        self._last_live = self._last_contact = time.monotonic()
        self._stop = threading.Event()
        self._sub: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._down_since: float | None = None  # the SUB's connection lost, not yet back
        self._replay = (None if spec.replay is None else
                        ReplayClient(ctx, spec.replay, config.replay_timeout_s, self._garbage))

    # -- loop --------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        self._stop = stop
        sub = self._sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 0)  # never drop on our side: a gap is the publisher's doing
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(self.spec.pub)
        self._health.update(self.label, "waiting for the publisher")
        try:
            while not stop.is_set():
                self._step(sub)
        finally:
            self._shutdown()

    def _step(self, sub: zmq.Socket[bytes]) -> None:
        self._watch_connection()
        if self.life.sink is not None and self.life.sink.needs_resync.is_set():
            self.resync("offloadd stream reset")
        if sub.poll(_POLL_MS, zmq.POLLIN):
            for _ in range(_DRAIN):
                try:
                    frames = sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.on_live(frames)
        elif time.monotonic() - self._last_live > self.config.idle_sync_s:
            self._idle()
        self._flush()
        stream = None if self.life.sink is None else self.life.sink.stream
        if stream is not None:
            self._metrics.pending.labels(self.label).set(stream.num_pending)
        self._health.update(
            self.label,
            "waiting for the publisher" if self.life.next_seq is None
            else f"following, next seq {self.life.next_seq}",
            connected=None if stream is None else stream.is_connected)

    def _watch_connection(self) -> None:
        """The SUB socket's connection to the publisher: one gone longer than its lease is taken
        for gone (its source cleared), with or without a replay socket; one that is back is
        checked at once (a restarted engine's first batches may have been sent before)."""
        assert self._monitor is not None
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._down_since = self._down_since or time.monotonic()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self._down_since is not None:
                self._down_since = None
                self._last_live = 0.0  # the idle check runs at the next quiet poll
        down = self._down_since
        if (down is not None and self.life.next_seq is not None
                and time.monotonic() - down > self.config.publisher_lease_s):
            self._lost_publisher()

    def _lost_publisher(self) -> None:
        log.warning("%s: publisher unreachable for %.0f s: clearing its source", self.label,
                    self.config.publisher_lease_s)
        self._metrics.resyncs.labels(self.label, "publisher unreachable").inc()
        self.life.end()

    def _shutdown(self) -> None:
        self._flush()
        sink = self.life.sink
        if sink is not None:
            if not sink.flush(5.0):
                log.warning("%s: batches not acked by offloadd before stopping", self.label)
            sink.close()
            self.life.sink = None
        if self._sub is not None and self._monitor is not None:
            self._sub.disable_monitor()
        for sock in (self._monitor, self._sub):
            if sock is not None:
                sock.close(linger=0)
        if self._replay is not None:
            self._replay.close()

    # -- live -------------------------------------------------------------------------------

    def on_live(self, frames: list[bytes]) -> None:
        try:
            frame = parse_live(frames, self._topic)
        except Garbage as exc:
            self._garbage(exc)
            return
        self._last_live = self._last_contact = time.monotonic()
        life = self.life
        if life.publisher_id and frame.publisher_id and frame.publisher_id != life.publisher_id:
            self.resync("publisher restarted (new identity)", frame)
            return
        expected = life.next_seq
        if expected is None:
            if self.spec.replay is not None:
                self.resync("first contact", frame)
            else:
                self._apply(frame)
        elif frame.seq == expected:
            self._apply(frame)
        elif frame.seq > expected:
            self._metrics.gaps.labels(self.label).inc()
            log.info("%s: gap, got seq %d, expected %d", self.label, frame.seq, expected)
            self._fill(frame)
        elif life.digest(frame.seq) == hash(frame.payload):
            self._metrics.duplicates.labels(self.label).inc()
        else:
            self.resync("publisher restarted (seq went back)", frame)

    def _fill(self, live: Frame | None) -> None:
        """Replay what follows the anchor; re-sync when the ring cannot fill the gap."""
        if self.spec.replay is None:
            self.resync("gap without a replay socket", live, use_ring=False)
            return
        life = self.life
        assert life.next_seq is not None
        anchor = life.anchor()
        frames = self._ask(anchor)
        if frames is None:
            self.resync("replay unreachable", live, use_ring=False)
            return
        verdict = continuity(life.next_seq, anchor, life.digest(anchor), frames)
        if verdict:
            self.resync(verdict, live)
            return
        for frame in frames:
            if frame.seq >= life.next_seq:
                self._apply(frame, replayed=True)
        if live is not None and live.seq >= life.next_seq:
            self._apply_after_fill(live)

    def _apply_after_fill(self, live: Frame) -> None:
        if live.seq == self.life.next_seq:
            self._apply(live)
        else:  # the replay ended before the live batch: nothing can fill that now
            self.resync("gap not filled by the replay", live, use_ring=False)

    def _idle(self) -> None:
        self._last_live = time.monotonic()
        if self.spec.replay is None:
            return
        life = self.life
        if life.next_seq is None:
            frames = self._ask(0)
            if frames:
                self.resync("first contact")
            return
        anchor = life.anchor()
        frames = self._ask(anchor)
        if frames is None:
            if time.monotonic() - self._last_contact > self.config.publisher_lease_s:
                self._lost_publisher()
            return
        self._last_contact = time.monotonic()
        verdict = continuity(life.next_seq, anchor, life.digest(anchor), frames)
        if verdict:
            self.resync(verdict)
            return
        missed = [f for f in frames if f.seq >= life.next_seq]
        if missed:
            self._metrics.gaps.labels(self.label).inc()
            log.info("%s: %d batches missed while quiet, replayed", self.label, len(missed))
        for frame in missed:
            self._apply(frame, replayed=True)

    # -- re-sync ----------------------------------------------------------------------------

    def resync(self, reason: str, live: Frame | None = None, *, use_ring: bool = True) -> None:
        """End the source's life and rebuild it from the ring (when asked and there is one)
        and ``live``."""
        self._metrics.resyncs.labels(self.label, reason).inc()
        if reason != "first contact":
            log.warning("%s: re-sync (%s): the source is cleared and rebuilt", self.label, reason)
        self.life.end()
        frames = self._ask(0) if use_ring and self.spec.replay is not None else None
        if frames:
            if frames[0].seq != 0:
                log.info("%s: the ring starts at seq %d: blocks stored before it are unknown",
                         self.label, frames[0].seq)
            for frame in frames:
                self._apply(frame, replayed=True)
        if live is not None and (self.life.next_seq is None or live.seq >= self.life.next_seq):
            self._apply(live)

    # -- applying (ingest.life) -------------------------------------------------------------

    def _apply(self, frame: Frame, *, replayed: bool = False) -> None:
        self.life.apply(frame, self._stop, replayed=replayed)

    def _flush(self) -> None:
        self.life.flush(self._stop)

    def _garbage(self, exc: Garbage) -> None:
        self._metrics.garbage.labels(self.label, exc.kind).inc()
        if exc.kind not in self._garbage_seen:  # once per kind: a flood must not flood the log
            self._garbage_seen.add(exc.kind)
            log.warning("%s: dropping what does not follow the wire (%s); further ones of this "
                        "kind are only counted (kvingest_garbage)", self.label, exc)

    def _ask(self, start: int) -> list[Frame] | None:
        assert self._replay is not None
        frames = self._replay.replay_from(start)
        if frames is not None:
            self._last_contact = time.monotonic()
        return frames
