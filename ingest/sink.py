"""One source's way into offloadd's log: an IngestStream per publisher life.

A publisher life is one incarnation of the source (DESIGN 3.8). :meth:`SourceSink.restart` ends
the current stream with a goodbye (the daemon clears the source's tiers) and opens the next
incarnation, whose first record clears them again in the log, so a consumer never mixes two
lives. The stream's own resets (the log lost, a batch refused) are reported through
``needs_resync``: the follower then re-syncs the source from the publisher's ring.

Batches applied together (:meth:`SourceSink.add`, then :meth:`SourceSink.send`) go to offloadd
as one batch of their events in order, split where it would pass MERGE_EVENTS events or
MERGE_VALUES values (block hashes plus token ids): a record stays far below gRPC's 4 MiB message
limit and the daemon's batch limit. A life's events not yet sent when it ends go with it (the
source is cleared).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Final

from events.schema import Event
from offloadd.client import ClientSecurity, IngestStream
from offloadd.client.ingest_stream import new_incarnation

log = logging.getLogger("kvingest")

_WAIT_STEP_S = 0.001
MERGE_EVENTS: Final = 1024
MERGE_VALUES: Final = 65_536


class SourceSink:
    def __init__(self, target: str, source: str, security: ClientSecurity, max_pending: int) -> None:
        self.target = target
        self.source = source
        self.security = security
        self.max_pending = max_pending
        self.needs_resync = threading.Event()
        self._stream: IngestStream | None = None
        self._incarnation = 0
        self._merged: list[Event] = []
        self._merged_values = 0

    @property
    def is_open(self) -> bool:
        return self._stream is not None

    @property
    def stream(self) -> IngestStream | None:
        return self._stream

    def restart(self) -> None:
        """End the current life (if any) and start a new incarnation."""
        self.close()
        self._incarnation = new_incarnation(self._incarnation)
        self._stream = IngestStream(
            self.target, self.source, self._incarnation, max_pending=self.max_pending * 2,
            on_reset=self._on_reset, credentials=self.security.credentials,
            token=self.security.token,
        )

    def submit(self, events: Sequence[Event], stop: threading.Event) -> None:
        """Queue one batch, waiting while ``max_pending`` are unacked (or until ``stop``)."""
        if self._stream is None:
            self.restart()
        stream = self._stream
        assert stream is not None
        while stream.num_pending >= self.max_pending and not stop.is_set():
            time.sleep(_WAIT_STEP_S)
        stream.submit(events)

    def add(self, events: Sequence[Event], values: int, stop: threading.Event) -> None:
        """Take one batch (``values``: its block hashes plus token ids) to send with the next."""
        if self._merged and (len(self._merged) + len(events) > MERGE_EVENTS
                             or self._merged_values + values > MERGE_VALUES):
            self.send(stop)
        self._merged.extend(events)
        self._merged_values += values

    def send(self, stop: threading.Event) -> None:
        """Submit what :meth:`add` took, as one batch."""
        if self._merged:
            self.submit(self._merged, stop)
        self._merged = []
        self._merged_values = 0

    def flush(self, timeout_s: float) -> bool:
        return True if self._stream is None else self._stream.flush(timeout_s)

    def close(self) -> None:
        """Say goodbye: the daemon clears this source's tiers (its engine is no longer followed)."""
        self._merged = []
        self._merged_values = 0
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self.needs_resync.clear()

    def _on_reset(self, incarnation: int) -> None:
        log.warning("offloadd stream of %s reset (new incarnation %d): re-syncing the source",
                    self.source, incarnation)
        self.needs_resync.set()
