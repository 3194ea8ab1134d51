"""The log's retention horizon (DESIGN.md 3.5; offloadd.log.checkpoint trims the log to it).

Each of ``retention_records``, ``retention_s`` and ``retention_bytes`` is a floor of what is
kept and the horizon is the oldest of them (the one keeping most), but never past the oldest
kept checkpoint's offset + 1 (recovery replays the log from there), and the last record always
stays (readers find the log's end and epoch in it).
"""

from __future__ import annotations

import time

from offloadd.config import OffloaddConfig
from offloadd.log.metadata import MetadataStore


async def horizon(md: MetadataStore, cfg: OffloaddConfig, kept: list[int], first: int,
                  length: int) -> int:
    """The first offset to keep, given the kept checkpoints' offsets ``kept`` (not empty) and
    the log's bounds (its ``first`` offset and ``length`` in records); reads Redis for the
    time and byte floors."""
    head = md.head
    floors = [head + 1]
    if cfg.retention_records:
        floors.append(head - cfg.retention_records + 1)
    if cfg.retention_s:
        floors.append(await first_since(md, time.time() - cfg.retention_s, first, head))
    if cfg.retention_bytes and length:
        usage = int(await md.client.memory_usage(md.keys.log) or 0)
        floors.append(head - cfg.retention_bytes * length // max(usage, 1) + 1)
    return min(min(floors), min(kept) + 1, head)


async def first_since(md: MetadataStore, cutoff: float, lo: int, hi: int) -> int:
    """The first offset in [lo, hi] whose record is stamped at or after ``cutoff``."""
    end = hi + 1
    while lo < end:
        mid = (lo + end) // 2
        records = await md.read_range(mid, 1, validate=False)
        if records and records[0].ts >= cutoff:
            end = mid
        else:
            lo = mid + 1
    return lo
