"""The bridge's ROUTER socket: replay from any seq still in the log (a seq trimmed from it is
answered from the oldest retained record, under that record's seq), and snapshots (WIRE.md).

Runs on its own thread and reads the log itself, so a long replay does not hold up live
publishing: it takes the bridge's lock only to look up where a seq lives (or to export the
state for a snapshot), then streams records from Redis in chunks. The ROUTER socket is in
mandatory mode so a slow requester makes us wait (up to a timeout) instead of losing frames.

A request names its stream by the optional topic frame (wire_frames); a plain 3-frame request, as
vLLM's clients send, means the one stream, or in per-source mode ``--default-source``'s. A request
for no stream is answered at once with an error end marker, ``[b"error: <why>", END, b""]``: every
vLLM client ends its replay on the END seq (and on the empty payload), instead of waiting for a
timeout, and our subscriber raises the error.

A bridge serving both layouts runs two of these (bridge.legacy_mirror): same streams and seqs,
each encoding in its own layout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import zmq

from bridge.config import BridgeConfig, Layout
from bridge.epoch import Preamble
from bridge.errors import PeerGone
from bridge.metrics import BridgeMetrics
from bridge.transcode import batch_for, relayout, takes_seq
from events.codec_vllm import encode_batch
from events.logreader import LogReader, LogUnavailable
from events.schema import BlockStored, SchemaError
from events.wire_frames import END_SEQ, BadRequest, ReplayRequest, parse_request, seq_bytes

log = logging.getLogger("kvbridge.replay")

SNAPSHOT_EVENTS_PER_BATCH = 64


@dataclass(frozen=True)
class ReplayPlan:
    """Records of ``source`` (None: all) in ``[start_offset, end_offset]`` get seqs from ``start_seq``."""

    topic: bytes
    source: str | None
    start_seq: int
    start_offset: int
    end_offset: int
    preamble: Preamble = ()  # a new epoch's clear batches, sent first (bridge.epoch)


@dataclass(frozen=True)
class SnapshotPlan:
    topic: bytes
    parts: tuple[tuple[str, tuple[BlockStored, ...]], ...]  # (source, events parents-first)
    next_seq: int


class ReplaySource(Protocol):
    def replay_plan(self, topic: bytes | None, start_seq: int) -> ReplayPlan | None: ...

    def snapshot_plan(self, topic: bytes | None) -> SnapshotPlan | None: ...

    def seq_from(self, topic: bytes, offset: int) -> int: ...


class ReplayServer:
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        config: BridgeConfig,
        reader: LogReader,
        source: ReplaySource,
        metrics: BridgeMetrics,
        *,
        layout: Layout | None = None,
        endpoint: str | None = None,
    ) -> None:
        self._config = config
        self._layout: Layout = layout or config.layout
        self._reader = reader
        self._source = source
        self._metrics = metrics
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, config.hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint or config.replay_endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvbridge-replay", daemon=True)

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100, zmq.POLLIN):
                continue
            frames = self._sock.recv_multipart()
            try:
                request = parse_request(frames)
            except BadRequest as exc:
                self._metrics.requests.labels("malformed").inc()
                log.warning("ignoring malformed replay request (%d frames): %s", len(frames), exc)
                continue
            try:
                self._handle(request)
            except PeerGone:
                log.info("replay requester went away")
            except Exception:  # one bad request must never stop the replay service
                log.exception("replay request failed")

    def _handle(self, request: ReplayRequest) -> None:
        topic = request.topic
        if topic is None and self._config.per_source and self._config.default_source:
            topic = self._config.topic_for(self._config.default_source).encode()
        if request.start_seq is None:
            self._metrics.requests.labels("snapshot").inc()
            try:
                snap = self._source.snapshot_plan(topic)
            except SchemaError as exc:  # a resident block whose packed token ids do not read
                self._answer_error(request.identity, f"the snapshot cannot be built: {exc}")
                return
            if snap is None:
                self._refuse(request.identity, topic)
                return
            self._send_snapshot(request.identity, snap)
            return
        self._metrics.requests.labels("replay").inc()
        plan = self._source.replay_plan(topic, request.start_seq)
        if plan is None:
            self._refuse(request.identity, topic)
            return
        sent = 0
        try:
            sent = self._send_replay(request.identity, plan)
        except LogUnavailable as exc:
            log.warning("replay from seq %d cut short: %s", request.start_seq, exc)
        log.info("replayed %d batches from seq %d", sent, plan.start_seq)
        self._send(request.identity, [b"", END_SEQ, b""])

    def _refuse(self, identity: bytes, topic: bytes | None) -> None:
        """Answer a request for no stream with the error end marker (module docstring)."""
        self._metrics.requests.labels("unknown_topic").inc()
        if topic is None:
            why = ("this bridge publishes one topic per source: add the topic as a 4th request "
                   "frame, or start the bridge with --default-source")
        else:
            why = f"no stream has topic {topic.decode(errors='replace')!r} (yet)"
        self._answer_error(identity, why)

    def _answer_error(self, identity: bytes, why: str) -> None:
        """The error end marker: ``why`` in the seq's place before END_SEQ (module docstring)."""
        log.warning("replay/snapshot request answered with an error: %s", why)
        self._send(identity, [b"error: " + why.encode(), END_SEQ, b""])

    def _send_replay(self, identity: bytes, plan: ReplayPlan) -> int:
        for seq_, payload in plan.preamble:  # encoded in the publisher's layout
            if self._layout != self._config.layout:
                payload = relayout(payload, self._layout)
            self._send(identity, [plan.topic, seq_bytes(seq_), payload])
        seq = plan.start_seq
        if plan.end_offset < plan.start_offset:
            return len(plan.preamble)
        layout = self._layout
        sent = 0
        for offset, data in self._reader.iter_range_raw(
            plan.start_offset, plan.end_offset, self._config.replay_chunk
        ):
            if seq == plan.start_seq and offset > plan.start_offset:
                # Trimmed since the plan (DESIGN 3.5): answer from the oldest retained record,
                # under its own seq, so the requester sees the jump.
                seq = self._source.seq_from(plan.topic, offset)
                log.warning("replay from seq %d: records before offset %d were trimmed; "
                            "answering from seq %d", plan.start_seq, offset, seq)
            batch = batch_for(data, layout)
            # Seqs are the publisher's, given in its layout: a mirror in another layout keeps
            # them even for a record it cannot encode (it sends nothing under that seq).
            numbered = batch if layout == self._config.layout else batch_for(data, self._config.layout)
            if not takes_seq(numbered, plan.source):
                continue  # the publisher's rule: such records took no seq
            if batch is not None:
                self._send(identity, [plan.topic, seq_bytes(seq), batch.payload])
                self._metrics.replayed_batches.inc()
                sent += 1
            seq += 1
        return sent + len(plan.preamble)

    def _send_snapshot(self, identity: bytes, snap: SnapshotPlan) -> None:
        layout = self._layout
        index = 0
        ts = time.time()
        for source, events in snap.parts:
            src = source if layout == "map" else None
            for batch in _chunks(events, SNAPSHOT_EVENTS_PER_BATCH):
                payload = encode_batch(batch, ts, layout=layout, source=src)
                self._send(identity, [snap.topic, seq_bytes(index), payload])
                index += 1
        self._send(identity, [b"", seq_bytes(snap.next_seq), b""])
        log.info("sent a snapshot of %d batches; continue from seq %d", index, snap.next_seq)

    def _send(self, identity: bytes, frames: list[bytes]) -> None:
        """Send one reply; wait while the requester's pipe is full, give up after a timeout."""
        deadline = time.monotonic() + self._config.replay_send_timeout_s
        msg = [identity, b"", *frames]
        while True:
            try:
                self._sock.send_multipart(msg, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                if self._stop.is_set() or time.monotonic() > deadline:
                    raise PeerGone() from None
                time.sleep(0.001)  # POLLOUT on a ROUTER does not track one peer's pipe
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    raise PeerGone() from None
                raise


def _chunks(events: Sequence[BlockStored], size: int) -> list[Sequence[BlockStored]]:
    return [events[i : i + size] for i in range(0, len(events), size)]
