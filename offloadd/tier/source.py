"""The daemon's own source in the log: its incarnation, its last seq, and slot generations.

The daemon logs its CPU-tier events (BlockStored/BlockRemoved "CPU", AllBlocksCleared) under
source ``offloadd``, fenced like an engine's by (incarnation, seq). Recovery decides where the
source stands; every landed record of the daemon moves it on.
"""

from __future__ import annotations

import time

from events.schema import LogRecord

DAEMON_SOURCE = "offloadd"
"""Source name of the daemon's own CPU-tier events in the log."""


class DaemonSource:
    def __init__(self) -> None:
        self._incarnation = 0
        self._seq = 0
        # Seeded from the wall clock (us): a restarted daemon never hands out a generation its
        # predecessor did (it would take a million assignments a second to catch up).
        self._last_generation = time.time_ns() // 1000

    @property
    def incarnation(self) -> int:
        return self._incarnation

    @property
    def seq(self) -> int:
        """Source seq of the daemon's last record in the log."""
        return self._seq

    def start(self, incarnation: int, seq: int) -> None:
        """Recovery decided where the source stands (kept, or a new incarnation)."""
        self._incarnation, self._seq = incarnation, seq

    def next_seq(self) -> int:
        return self._seq + 1

    def logged(self, record: LogRecord) -> None:
        """One of the daemon's own records is in the log: its seq is the position now."""
        self._seq = record.source_seq

    def next_generation(self) -> int:
        """A new slot assignment's generation: daemon-wide, strictly increasing, never 0. An
        engine that read a slot it remembered checks the pin's answer against it."""
        self._last_generation += 1
        return self._last_generation

    def next_generations(self, n: int) -> range:
        """``n`` new generations at once (recovery's restored blocks)."""
        first = self._last_generation + 1
        self._last_generation += n
        return range(first, first + n)
