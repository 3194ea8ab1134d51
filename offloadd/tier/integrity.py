"""Checksums of the host tier's blocks: which are unverified, which failed and await removal.

A block restored by a warm restart is served only after its bytes matched its xxh3 checksum:
checked in the background (:meth:`Integrity.verify_restored`) or on demand by the first
Lookup/ReadBlocks that would return it. A mismatch takes it out of service; its removal is
logged by the sweeper (StoreWriter.drop_corrupt).

The same path takes out blocks whose bytes another process destroyed by resizing their chunk
file (:meth:`Integrity.check_files`): the file is given back its size, the blocks it no longer
held are removed, a commit of the slots it lost while reserved fails.
"""

from __future__ import annotations

import asyncio
import logging
from itertools import repeat

from offloadd.tier.index import BlockState
from offloadd.tier.layouts import ArenaDamaged, Layout, LayoutTable

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
        try:
            if layout.checksum(entry.slot) == entry.checksum:
                layout.index.mark_verified(digest)
                return True
            log.error("checksum mismatch: layout %d slot %d", layout.layout_id, entry.slot)
        except ArenaDamaged:
            self.check_files(layout)  # its file shrank: report it, and every block it lost
        self._take_out(layout, digest)
        return False

    def _take_out(self, layout: Layout, digest: bytes) -> None:
        entry = layout.index.entry(digest)
        if entry.state is not BlockState.READY:
            return  # already on its way out
        layout.index.mark_unverified(digest)  # a pinned one misses until checked again
        if entry.pins == 0:
            layout.index.mark_evicting(digest)
            self._corrupt.add((layout.layout_id, digest))

    def check_files(self, layout: Layout) -> int:
        """Find the layout's files that another process resized, give them back their size
        and take out of service every block whose bytes they lost. Returns how many."""
        layout.generations.check()
        resized = layout.arena.check()
        if not resized:
            return 0
        lost = {s for chunk, size in resized.items() for s in layout.arena.lost_slots(chunk, size)}
        hit = [(d, e.state) for d, e in layout.index.entries.items() if e.slot in lost]
        for digest, state in hit:
            if state is BlockState.RESERVED:
                layout.index.mark_lost(digest)
            else:
                self._take_out(layout, digest)
        log.error("layout %d: %d blocks lost to resized arena chunks %s", layout.layout_id,
                  len(hit), sorted(resized))
        return len(hit)

    def check_all(self) -> int:
        return sum(self.check_files(layout) for layout in self._layouts.by_id.values())

    def add_unverified(self, layout_id: int, digests: list[bytes]) -> None:
        self._unverified.extend(zip(repeat(layout_id), digests))

    async def verify_restored(self, batch: int = 2048) -> tuple[int, int]:
        """Background check of blocks restored at start and not yet looked up; returns
        (verified, failed). Yields to the loop between batches so serving goes on. First, what
        the restore left to first use (LayoutIndex.settle_steps), so no request waits for it."""
        for layout in list(self._layouts.by_id.values()):
            for _ in layout.index.settle_steps():
                await asyncio.sleep(0)
        ok = failed = 0
        while self._unverified:
            matched: dict[int, list[bytes]] = {}  # published per layout with one write
            for _ in range(min(batch, len(self._unverified))):
                layout_id, digest = self._unverified.pop()
                layout = self._layouts.by_id[layout_id]
                entry = layout.index.get(digest)
                if entry is None or entry.verified or entry.state is not BlockState.READY:
                    continue
                if self._matches(layout, entry.slot, entry.checksum):
                    matched.setdefault(layout_id, []).append(digest)
                elif self.verify(layout, digest):  # False here; verify takes it out
                    ok += 1
                else:
                    failed += 1
            for layout_id, digests in matched.items():
                self._layouts.by_id[layout_id].index.mark_verified_many(digests)
                ok += len(digests)
            await asyncio.sleep(0)
        return ok, failed

    @staticmethod
    def _matches(layout: Layout, slot: int, checksum: int) -> bool:
        try:
            return layout.checksum(slot) == checksum
        except ArenaDamaged:
            return False  # verify() reports the file and takes out what it lost

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
