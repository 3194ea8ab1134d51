"""Checksums of the host tier's blocks: which are unverified, which failed and await removal.

A block restored by a warm restart is served only after its bytes matched its xxh3 checksum:
checked in the background (:meth:`Integrity.verify_restored`) or on demand by the first
Lookup/ReadBlocks that would return it. A mismatch takes it out of service; its removal is
logged by the sweeper (StoreWriter.drop_corrupt).
"""

from __future__ import annotations

import asyncio
import logging

from offloadd.tier.index import BlockState
from offloadd.tier.layouts import Layout, LayoutTable

log = logging.getLogger(__name__)


class Integrity:
    """Owns the tier's sets of unverified and corrupt blocks, as (layout_id, digest)."""

    def __init__(self, layouts: LayoutTable) -> None:
        self._layouts = layouts
        self._corrupt: set[tuple[int, bytes]] = set()  # failed their checksum, removal pending
        self._unverified: list[tuple[int, bytes]] = []  # restored at start, not yet checked

    def verify(self, layout: Layout, digest: bytes) -> bool:
        """Check a READY block's bytes; a mismatch takes it out of service (removal logged by
        the sweeper) unless someone holds a pin on it, in which case it only misses now."""
        entry = layout.index.entry(digest)
        if layout.checksum(entry.slot) == entry.checksum:
            layout.index.mark_verified(digest)
            return True
        log.error("checksum mismatch: layout %d slot %d", layout.layout_id, entry.slot)
        if entry.pins == 0:
            layout.index.mark_evicting(digest)
            self._corrupt.add((layout.layout_id, digest))
        return False

    def add_unverified(self, layout_id: int, digests: list[bytes]) -> None:
        self._unverified.extend((layout_id, d) for d in digests)

    async def verify_restored(self, batch: int = 2048) -> tuple[int, int]:
        """Background check of blocks restored at start and not yet looked up; returns
        (verified, failed). Yields to the loop between batches so serving goes on."""
        ok = failed = 0
        while self._unverified:
            for _ in range(min(batch, len(self._unverified))):
                layout_id, digest = self._unverified.pop()
                layout = self._layouts.by_id[layout_id]
                entry = layout.index.get(digest)
                if entry is None or entry.verified or entry.state is not BlockState.READY:
                    continue
                if self.verify(layout, digest):
                    ok += 1
                else:
                    failed += 1
            await asyncio.sleep(0)
        return ok, failed

    @property
    def has_corrupt(self) -> bool:
        return bool(self._corrupt)

    def corrupt_by_layout(self) -> dict[int, list[bytes]]:
        """Blocks that failed their checksum and whose removal is still to be logged."""
        by_layout: dict[int, list[bytes]] = {}
        for layout_id, digest in sorted(self._corrupt):
            by_layout.setdefault(layout_id, []).append(digest)
        return by_layout

    def forget_corrupt(self, layout_id: int, digests: list[bytes]) -> None:
        """Their removal is logged."""
        self._corrupt.difference_update((layout_id, d) for d in digests)
