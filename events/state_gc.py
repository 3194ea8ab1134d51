"""Keeping CPython's cyclic collector off the path of whoever holds a CacheState.

A state holds millions of small long-lived objects; full collections walk all of them (100+ ms
pauses at a few 100k blocks, and twice the CPU per record). Whatever is alive after a chunk of
applied records is long-lived state, so it is moved out of the collector's view (``gc.freeze``,
O(1)); what dies later is freed by reference counting. Cyclic garbage, which only the collector
frees, is rare here; a full collection reclaims it every ``full_interval_s``. kv-bridge calls it
after each publish chunk, a router's follower after each bootstrap and each poll that applied
batches.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("kvstate")


class GcPolicy:
    """Freeze after every chunk; a full collection at most every ``full_interval_s``."""

    def __init__(self, full_interval_s: float) -> None:
        self._full_interval_s = full_interval_s
        self._last_full = time.monotonic()
        self.num_full = 0

    def after_chunk(self) -> None:
        gc.freeze()
        now = time.monotonic()
        if now - self._last_full >= self._full_interval_s:
            started = time.perf_counter()
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            self._last_full = now
            self.num_full += 1
            log.info("full garbage collection took %.1f ms", (time.perf_counter() - started) * 1e3)
