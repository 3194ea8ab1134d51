"""A one-line progress report on stderr for long replays (no dependency; redrawn at most 5x/s)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``label: done/total unit (pct) rate/s``; silent unless ``enabled`` (default: a TTY)."""

    def __init__(
        self, label: str, total: int | None, unit: str = "records",
        enabled: bool | None = None, stream: TextIO | None = None,
    ) -> None:
        self._stream = stream or sys.stderr
        self._enabled = self._stream.isatty() if enabled is None else enabled
        self._label, self._total, self._unit = label, total, unit
        self._start = self._last = time.monotonic()
        self._done = 0
        self._drawn = False

    def advance(self, n: int = 1) -> None:
        self._done += n
        now = time.monotonic()
        if self._enabled and now - self._last >= 0.2:
            self._last = now
            self._draw(now)

    def close(self) -> None:
        if self._enabled and (self._drawn or self._done):
            self._draw(time.monotonic())
            self._stream.write("\n")
            self._stream.flush()

    def _draw(self, now: float) -> None:
        rate = self._done / max(now - self._start, 1e-9)
        if self._total:
            pct = min(100.0, 100.0 * self._done / self._total)
            text = f"{self._label}: {self._done}/{self._total} {self._unit} ({pct:.0f}%)"
        else:
            text = f"{self._label}: {self._done} {self._unit}"
        self._stream.write(f"\r{text} {rate:,.0f}/s ")
        self._stream.flush()
        self._drawn = True
