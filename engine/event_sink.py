"""Where each step's KV events go: the interface, a null sink and an in-memory recording sink.

The real sink (engine/ingest_sink.IngestEventSink) wraps offloadd's IngestStream; the engine core only knows
this interface and calls ``publish`` once per step that produced events. ``publish`` must never
block generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from events.schema import Event


class EventSink(Protocol):
    def publish(self, events: Sequence[Event]) -> None:
        """Hand over one step's events (non-empty, in mutation order); never blocks."""
        ...

    def take_resync(self) -> bool:
        """True once after the transport had to drop events (it started a new incarnation): the
        engine then publishes its whole cached state (KVCacheManager.snapshot_events) as its very
        next ``publish``, nothing when it holds nothing: that batch opens the new incarnation."""
        ...

    def close(self) -> None: ...


class NullEventSink:
    def publish(self, events: Sequence[Event]) -> None:
        pass

    def take_resync(self) -> bool:
        return False

    def close(self) -> None:
        pass


class RecordingEventSink:
    """Keeps every batch in memory (tests, ``kv-engine generate --show-events``)."""

    def __init__(self) -> None:
        self.batches: list[list[Event]] = []

    def publish(self, events: Sequence[Event]) -> None:
        self.batches.append(list(events))

    def take_resync(self) -> bool:
        return False

    @property
    def events(self) -> list[Event]:
        return [e for batch in self.batches for e in batch]

    def take(self) -> list[Event]:
        out = self.events
        self.batches.clear()
        return out

    def close(self) -> None:
        pass
