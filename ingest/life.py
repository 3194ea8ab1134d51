"""The publisher life kv-ingest follows for one source, and applying its batches.

A life is what the follower holds between two re-syncs: the next seq it expects, digests of the
batches it applied lately (ingest.follower compares them with a replay to tell the same life
from a restart), the publisher's data parallel rank and identity, and the sink that hands the
batches to offloadd. Ending the life closes the sink: its stream says goodbye and the daemon
clears the source's tiers; the next batch applied opens a new one.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Final

from events.schema import BlockRemoved, BlockStored
from ingest.config import IngestConfig, source_name
from ingest.errors import Garbage
from ingest.metrics import IngestMetrics
from ingest.sink import SourceSink
from ingest.wire import Frame, decode
from offloadd.client import ClientSecurity

log = logging.getLogger("kvingest")

RECENT: Final = 20_000  # digests kept: more than vLLM's ring (10,000 batches)


class SourceLife:
    def __init__(self, name: str, label: str, config: IngestConfig, security: ClientSecurity,
                 metrics: IngestMetrics, on_garbage: Callable[[Garbage], None]) -> None:
        self.name = name  # the source's name, without the rank
        self.label = label
        self._config = config
        self._security = security
        self._metrics = metrics
        self._on_garbage = on_garbage
        self.next_seq: int | None = None  # None: no life followed
        self.rank: int | None = None
        self.sink: SourceSink | None = None
        self.publisher_id = b""  # from 24-byte seq frames only (replies carry none)
        self._recent: dict[int, int] = {}
        self._recent_order: deque[int] = deque()
        self._m_batches = metrics.batches.labels(label)
        self._m_blocks = metrics.block_events.labels(label)
        self._m_next = metrics.next_seq.labels(label)

    def digest(self, seq: int) -> int | None:
        """The digest of the batch applied at ``seq``, while it is kept."""
        return self._recent.get(seq)

    def anchor(self) -> int:
        """Where to ask a replay from: the last seq applied while its digest is kept (the replay
        then shows whether it is the same life), else the next one."""
        assert self.next_seq is not None
        return self.next_seq - 1 if self.next_seq - 1 in self._recent else self.next_seq

    def apply(self, frame: Frame, stop: threading.Event, *, replayed: bool = False) -> None:
        """Decode ``frame`` and add its events to the sink (opening a life if none is open)."""
        try:
            batch = decode(frame.payload)
        except Garbage as exc:
            self._on_garbage(exc)
            # Its events are lost: the source is re-synced from what follows.
            self._metrics.resyncs.labels(self.label, "undecodable batch").inc()
            self.end()
            self._advance(frame)
            return
        if self.rank is not None and batch.dp_rank != self.rank:
            log.warning("%s: data_parallel_rank %d after %d: a new publisher", self.label,
                        batch.dp_rank, self.rank)
            self._metrics.resyncs.labels(self.label, "data_parallel_rank changed").inc()
            self.end()
        if self.sink is None:
            self.rank = batch.dp_rank
            self.sink = SourceSink(self._config.offloadd, source_name(self.name, batch.dp_rank),
                                   self._security, self._config.max_pending)
        if batch.num_skipped:
            self._metrics.skipped.labels(self.label).inc(batch.num_skipped)
        if batch.events:
            blocks = tokens = 0
            for e in batch.events:
                if type(e) is BlockStored:
                    blocks += len(e.block_hashes)
                    tokens += len(e.token_ids)
                elif type(e) is BlockRemoved:
                    blocks += len(e.block_hashes)
            self.sink.add(batch.events, blocks + tokens, stop)
            self._m_batches.inc()
            self._m_blocks.inc(blocks)
        if replayed:
            self._metrics.replayed.labels(self.label).inc()
        self._advance(frame)

    def flush(self, stop: threading.Event) -> None:
        """Hand what was applied to offloadd: the batches that waited together go as one."""
        if self.sink is not None:
            self.sink.send(stop)

    def end(self) -> None:
        if self.sink is not None:
            self.sink.close()  # goodbye: the daemon clears the source's tiers
            self.sink = None
        self.next_seq = None
        self.rank = None
        self.publisher_id = b""
        self._recent.clear()
        self._recent_order.clear()

    def _advance(self, frame: Frame) -> None:
        self.next_seq = frame.seq + 1
        if frame.publisher_id:
            self.publisher_id = frame.publisher_id
        self._recent[frame.seq] = hash(frame.payload)
        self._recent_order.append(frame.seq)
        if len(self._recent_order) > RECENT:
            self._recent.pop(self._recent_order.popleft(), None)
        self._m_next.set(self.next_seq)
