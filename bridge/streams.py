"""The streams a bridge publishes, each a topic with its own contiguous seq (bridge.seqindex):
the mixed stream of every source, one fixed source's (``--source``), or in per-source mode one
a source, made as the sources appear. Which stream a record goes on, how the numbering carries
over a restart, a trimmed log and an epoch, and what a replay or a snapshot of one sends.

Callers hold the bridge's lock.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from bridge.config import BridgeConfig, Layout
from bridge.epoch import Preamble, clear_batches
from bridge.position import SavedPosition
from bridge.replay_server import ReplayPlan, SnapshotPlan
from bridge.seqindex import SeqIndex
from bridge.transcode import Transcoded, takes_seq
from events.state import Snapshot

log = logging.getLogger("kvbridge")


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

    def open_epoch(self, first: int, known: Sequence[str], layout: Layout) -> Preamble:
        """Number a new log epoch from seq ``first``: its clear batches (bridge.epoch) of this
        stream's source, or of every ``known`` source, take the first seqs; returned to send."""
        sources = [self.source] if self.source is not None else known
        self.preamble = clear_batches(sources, first, layout)
        self.index = SeqIndex(first + len(self.preamble))
        return self.preamble

    def snapshot_plan(self, snap: Snapshot) -> SnapshotPlan:
        """The part of ``snap`` this stream publishes, and the seq that follows it."""
        parts = tuple(
            (s.source, s.events)
            for s in snap.sources
            if s.events and (self.source is None or s.source == self.source)
        )
        return SnapshotPlan(self.topic_bytes, parts, self.index.next_seq)


class Streams:
    def __init__(self, config: BridgeConfig) -> None:
        self._config = config
        self._by_topic: dict[str, PublishedStream] = {}
        if config.source is not None:
            self.for_source(config.source)
        elif not config.per_source:
            self._by_topic[config.topic] = PublishedStream(config.topic, None)

    def all(self) -> list[PublishedStream]:
        return list(self._by_topic.values())

    @property
    def metric_topic(self) -> str:
        """The topic label of the published-batches counter: the one stream's, or ``*``."""
        return next(iter(self._by_topic)) if len(self._by_topic) == 1 else "*"

    def next_seqs(self) -> dict[str, int]:
        return {t: s.index.next_seq for t, s in self._by_topic.items()}

    def base_seqs(self) -> dict[str, int]:
        return {t: s.index.base_seq for t, s in self._by_topic.items()}

    def for_source(self, source: str) -> PublishedStream | None:
        """The stream that publishes ``source``'s records (None: no stream does)."""
        config = self._config
        if config.per_source or config.source == source:
            topic = config.topic_for(source)
            stream = self._by_topic.get(topic)
            if stream is None:
                stream = self._by_topic[topic] = PublishedStream(topic, source)
            return stream
        if config.source is not None:
            return None
        return self._by_topic[config.topic]

    def by_topic(self, topic: bytes | None) -> PublishedStream | None:
        if topic is None:
            # A plain request names no topic: fine with one fixed stream; with --per-source the
            # streams come and go with the sources, so the topic frame is required.
            return None if self._config.per_source else next(iter(self._by_topic.values()))
        return self._by_topic.get(topic.decode(errors="replace"))

    def index(self, offset: int, batch: Transcoded | None) -> PublishedStream | None:
        """Give the record its seq on the stream that publishes it (if any)."""
        if batch is None:
            log.error("log entry %d cannot be decoded; it is not published", offset)
            return None
        stream = self.for_source(batch.source)
        if stream is None or not stream.wants(batch):
            return None
        stream.index.append(offset)
        return stream

    def reset(self) -> None:
        """Number from scratch (the log is scanned again)."""
        for stream in self._by_topic.values():
            stream.index = SeqIndex()

    def rebase(self, saved: SavedPosition | None, first: int, epoch: str | None, jumped: bool) -> None:
        """After trimming, old records are gone: continue the saved numbering instead (the mixed
        stream keeps seq = offset - 1 when the position ``jumped`` over trimmed records). After
        an epoch change the numbering starts at the saved base of the epoch."""
        if first <= 1:
            if saved is not None and saved.epoch and saved.epoch == epoch:
                for topic, stream in self._by_topic.items():
                    if saved.base_seqs.get(topic):
                        stream.index.rebase(saved.base_seqs[topic])
            return
        for topic, stream in self._by_topic.items():
            if jumped and stream.source is None:
                stream.index.rebase(first - 1)
            elif saved is not None and topic in saved.next_seqs:
                stream.index.rebase(max(0, saved.next_seqs[topic] - len(stream.index)))
            elif stream.source is None:
                stream.index.rebase(first - 1)

    def skip(self, skipped: int) -> None:
        """``skipped`` records were trimmed before they were read: the mixed stream's seqs jump
        with the offsets (seq = offset - 1 stays), so subscribers see the gap. A per-source
        stream cannot know how many of them were its own: it does not."""
        for stream in self._by_topic.values():
            if stream.source is None:  # everything before the gap left the log: shifting is safe
                stream.index.rebase(stream.index.base_seq + skipped)

    def replay_plan(self, topic: bytes | None, start_seq: int) -> ReplayPlan | None:
        stream = self.by_topic(topic)
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
        stream = self.by_topic(topic)
        if stream is None:
            return 0
        return stream.index.base_seq + stream.index.count_through(offset - 1)
