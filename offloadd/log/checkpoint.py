"""Checkpoints of the reduced state, and the log's retention horizon (DESIGN.md 3.5).

A checkpoint is ``CacheState.export()`` at an offset O: every source's tiers, fences and
incarnations, exactly what the reducer holds after the log up to O. What recovery reads besides
the log (layouts, engines, the daemon's fields, the block projection) lives in keys of its own
that are written with the records and never trimmed: it is current state, not history, so it is
not copied here (a copy as of O would only be older than the keys recovery reads).

Writing (:class:`Checkpointer`, a background task of the daemon):

1. the snapshot is the reducer's state at its offset O (records reach the reducer only once the
   log holds them, so the state at O is what the log holds up to O): of a tier that only grew
   since the previous checkpoint, only the blocks from that one's last segment on are cut
   again (events.checkpoint_delta), and of a tier with removals only the segments they
   touched (events.checkpoint_dirty, DECISIONS 68), copied at O (a tier's tail: read after O
   while its changes since leave it where it was, offloadd.log.later_read, DECISIONS 74 and
   81) and cut in the loop in ~1 ms slices;
   when more than ``checkpoint_fork_blocks`` are to be cut (the first checkpoint after
   a start, a tier cleared), a forked child cuts them from its copy-on-write copy
   (offloadd.log.forked_export, DECISIONS 65);
2. the chunks are content-addressed and shared between checkpoints (format 2 of
   events.checkpoint, cut by events.checkpoint_cut, DECISIONS 60): a tier cut whole re-encodes
   only the segments whose content fingerprint the last checkpoint written did not have; bytes
   are produced only for chunks the kept checkpoints do not list, and written to
   ``ckpt:chunk:{address}`` as they arrive. A checkpoint thus costs Redis, and the export's
   CPU, what changed, not the state;
3. one script checks that every chunk the manifest lists exists, writes the manifest (offset,
   epoch, fences, the chunks' addresses) and swaps the pointer ``ckpt`` (ids of the complete
   checkpoints, newest first), after checking the owner lease and that the pointer is the one
   we read: a failure before this leaves the previous one in force;
4. checkpoints that left the pointer are deleted (``KEEP`` stay: the newest and the one before,
   so a torn newest falls back to its predecessor), with the chunks no kept checkpoint lists
   (those of dropped checkpoints and of writes that never finished): a chunk a kept manifest
   lists is never deleted;
5. the log is trimmed to the retention horizon (offloadd.log.retention: the oldest of the
   retention floors, never past the oldest kept checkpoint's offset + 1; the last record
   always stays).

The format (manifest, chunks, checksums, the usability rule) is events.checkpoint, shared with
kv-bridge and kvctl, which bootstrap from the same checkpoints; this module does the daemon's
Redis I/O around it.

Loading, by recovery, is offloadd.log.checkpoint_load (re-exported here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Final

from events.checkpoint import (
    CHUNK_EVENTS,
    FORMAT,
    CheckpointBroken,
    Manifest,
    checkpoint_id,
    decode_manifest,
    encode_ids,
    encode_manifest,
    join,
    split,
)
from events.checkpoint_book import CutBook
from events.checkpoint_cut import Cuts, fences, preload
from offloadd.config import OffloaddConfig
from offloadd.log.checkpoint_load import CheckpointMissing, get_key, load, pointer_ids, restore
from offloadd.log.checkpoint_store import CheckpointFailed, CheckpointStore
from offloadd.log.forked_export import ExportFailed, export_pieces
from offloadd.log.later_read import Later, TierMoved
from offloadd.log.metadata import LogConflict, MetadataStore, RedisUnavailable
from offloadd.log.retention import horizon

log = logging.getLogger(__name__)

KEEP: Final[int] = 2  # complete checkpoints kept: the newest and its fallback
_ABSORB_STEP: Final[int] = 5_000  # removed hashes placed per slice (~0.6-1.4 ms on the 2-core VM)
# A tier with removals whose touched segments hold more blocks than this is cut whole, read by
# the forked child from its copy of the state, instead of copied at the instant (~30 ns a block).
_PLAN_BLOCKS: Final[int] = 250_000


@dataclass
class CheckpointStats:
    """Read by the metrics thread; written by the checkpoint task."""

    offset: int = 0
    created_ts: float = 0.0
    num_bytes: int = 0
    first_offset: int = 0
    log_length: int = 0
    num_written: int = 0
    bytes_sent: int = 0  # the newest checkpoint's new chunks: what writing it cost Redis
    blocks_cut: int = 0  # the blocks the newest checkpoint's export cut (the rest reused as cut)
    forked: bool = False  # whether that export ran in a forked child (else in the loop)
    num_failed: int = 0
    num_trimmed: int = 0


__all__ = [
    "CHUNK_EVENTS",
    "KEEP",
    "CheckpointFailed",
    "CheckpointMissing",
    "CheckpointStats",
    "Checkpointer",
    "Cuts",
    "Manifest",
    "checkpoint_id",
    "join",
    "load",
    "restore",
    "split",
]


class Checkpointer:
    """Writes checkpoints and trims the log (module docstring); the daemon runs :meth:`run`."""

    def __init__(self, md: MetadataStore, config: OffloaddConfig, epoch: str) -> None:
        self.md = md
        self.config = config
        self.epoch = epoch
        self.stats = CheckpointStats()
        self.cuts = Cuts()
        self.batch_bytes = 1 << 20  # new chunks' bytes per script call
        self.read_window = 16_384  # blocks of a tier read after the instant per slice (~0.5 ms)
        self.fork = True  # large exports in a forked child (offloadd.log.forked_export); False: in the loop
        self.fork_blocks = config.checkpoint_fork_blocks  # more blocks to cut than this: forked
        self.store = CheckpointStore(md, epoch)
        self._pointer: bytes | None = None  # the pointer as last read or written
        # The last written checkpoint's cut, per tier (events.checkpoint_delta), and what
        # changed since in the reducer besides appends (the segments a removal touched).
        self._book = CutBook()
        self.track_removals = True  # False: a tier with removals is cut whole (as before 68)
        self._moved = False  # the last export was given up (TierMoved): the next copies tails

    def watch(self) -> None:
        """Have the reducer record its changes from now on (``run`` does, at its start), so that
        the first export knows which tiers changed otherwise than by appends and copies their
        tails at its instant. Otherwise they look append-only to it: it reads them after its
        instant and is given up at their first eviction, as it was after every restart under an
        evicting engine (DECISIONS 81)."""
        self.md.state.track_changes()

    async def run(self) -> None:
        cfg = self.config
        last = time.monotonic()
        self.watch()
        await self._quietly(self.prime())
        preloaded = False
        while True:
            await asyncio.sleep(min(1.0, cfg.checkpoint_interval_s))
            behind = self.md.state.offset - self.stats.offset
            is_time = time.monotonic() - last >= cfg.checkpoint_interval_s
            if behind >= cfg.checkpoint_records or (behind > 0 and is_time):
                if not preloaded:  # off the loop, before the first cut (DECISIONS 74), and not
                    # right after SERVING, when a restart's clients come back (DECISIONS 79)
                    await asyncio.to_thread(preload)
                    preloaded = True
                last = time.monotonic()
                await self._quietly(self.write())
            if is_time or behind >= cfg.checkpoint_records:
                last = time.monotonic()
                await self._quietly(self.trim())

    async def _quietly(self, step: Any) -> None:
        try:
            await step
        except (CheckpointFailed, RedisUnavailable, LogConflict) as exc:
            self.stats.num_failed += 1
            log.warning("checkpoint or trim failed, the previous checkpoint stays: %s", exc)
        except Exception:
            self.stats.num_failed += 1
            log.exception("checkpoint or trim failed")

    async def prime(self) -> None:
        """Stats of the newest checkpoint in Redis, and the log's bounds."""
        self._pointer = await get_key(self.md, self.md.keys.checkpoint) or b""
        for ckpt_id in pointer_ids(self._pointer)[:1]:
            raw = await get_key(self.md, self.md.keys.checkpoint_manifest(ckpt_id))
            try:
                manifest = decode_manifest(raw, ckpt_id)
            except CheckpointBroken:
                continue
            if manifest.epoch == self.epoch:
                self._note(manifest)
        await self.store.referenced(pointer_ids(self._pointer))
        await self._bounds()

    def _note(self, manifest: Manifest) -> None:
        s = self.stats
        s.offset, s.created_ts, s.num_bytes = manifest.offset, manifest.created_ts, manifest.num_bytes

    async def write(self) -> Manifest | None:
        """Write a checkpoint of the state now; None when there is nothing new.

        A forked export child that dies (status 11 was seen while gRPC's fork handlers were on,
        DECISIONS 51; anything else that kills it) costs one export in the loop, not the
        checkpoint: the stall of the pre-fork path, the guarantee kept."""
        try:
            return await self._write(self.fork)
        except CheckpointFailed as exc:
            if not (self.fork and isinstance(exc.__cause__, ExportFailed)):
                raise
            log.warning("checkpoint export child failed (%s); exporting in the loop this time", exc)
            return await self._write(False)

    async def _write(self, fork: bool) -> Manifest | None:
        if self.md.state.offset in (0, self.stats.offset):
            return None
        if self._pointer is None:
            self._pointer = await get_key(self.md, self.md.keys.checkpoint) or b""
        try:
            present = await self.store.present(pointer_ids(self._pointer))
        except RedisUnavailable as exc:
            raise CheckpointFailed(str(exc)) from exc
        book = self._book
        known = book.known(present)
        state = self.md.state
        state.track_changes()  # from the first export on (what it cuts is the reference)
        book.mapping = self.track_removals  # no maps: a tier with removals is cut whole
        for _ in book.absorb(state.take_changes(), step=_ABSORB_STEP):
            await asyncio.sleep(0)  # removals placed on segments a slice at a time
        await asyncio.sleep(0)  # the loop runs between this work and the instant's copy
        offset = state.offset  # no await from here to the copy or the fork in export_pieces
        ckpt_id = checkpoint_id(self.epoch, offset)
        sources, fork_s = fences(state), list[float]()
        book.note(state.take_changes())  # what was applied meanwhile
        parts = book.plan(state, present, copy=False, cuts=self.cuts,
                          limit=_PLAN_BLOCKS if fork else None)
        todo = sum(p.todo for p in parts)
        fork = fork and todo > self.fork_blocks
        book.begin(parts)
        addresses: list[str] = []
        batch: dict[str, bytes] = {}
        size = sent = 0
        # The state at exactly `offset`: copied, or a forked child's copy, before this coroutine
        # yields again (offloadd.log.forked_export).
        # Tails are read when their turn comes, not copied at the instant (later_read), where
        # something lies before them: a tier that only ever grew, or one the book has a map of.
        # A tier cut whole with removals would lose its read to its next eviction: copied.
        lazy = set() if self._moved else {
            p.tier for p in parts
            if p.tier not in book.changing or (p.stretches[-1].start > 0 and p.tier in book.maps)}
        later = Later(lazy, lambda tid: state.pending_changes(*tid), book.maps.get, self.read_window)
        chunks = export_pieces(parts, self.cuts, known, present, fork, fork_s, later)
        try:
            async with contextlib.aclosing(chunks):
                async for piece in chunks:
                    book.add(piece)  # ValueError: a piece that does not fit (below)
                    addresses.append(piece.address)
                    size += piece.length
                    if piece.data is not None and piece.address not in present:
                        present.add(piece.address)
                        batch[piece.address] = piece.data
                        sent += piece.length
                        if sum(map(len, batch.values())) >= self.batch_bytes:
                            await self.store.write(batch)
            await self.store.write(batch)
            book.check()  # every tier's blocks came: the previous cut once the swap is done
        except TierMoved as exc:  # not an export that failed: no second try in the loop
            self._moved = True  # the next export copies every tail at its instant
            raise CheckpointFailed(str(exc)) from None
        except (ExportFailed, ValueError) as exc:
            raise CheckpointFailed(str(exc)) from exc
        manifest = Manifest(ckpt_id, offset, self.epoch, time.time(), (0,), size, FORMAT,
                            tuple(addresses), sources)
        kept = tuple(dict.fromkeys((ckpt_id, *pointer_ids(self._pointer))))[:KEEP]
        pointer = encode_ids(kept)
        try:
            await self.store.put([(self.md.keys.checkpoint_manifest(ckpt_id), encode_manifest(manifest)),
                              (self.md.keys.checkpoint, pointer)], expect=self._pointer,
                             must_exist=[self.md.keys.checkpoint_content(a) for a in set(addresses)])
        except CheckpointFailed:
            self._pointer = None  # in doubt or moved: read it again next time
            self.store.forget()  # and what the kept checkpoints list and Redis holds
            raise
        self._pointer = pointer
        self._moved = False
        self.store.listed[ckpt_id] = frozenset(addresses)
        book.commit()
        self._note(manifest)
        self.stats.num_written += 1
        self.stats.bytes_sent = sent
        self.stats.blocks_cut, self.stats.forked = todo, fork
        log.info("checkpoint %s written: offset %d, %d chunks, %d bytes; %d bytes new; %d blocks "
                 "cut %s", ckpt_id, offset, len(addresses), manifest.num_bytes, sent, todo,
                 f"(forked in {sum(fork_s) * 1e3:.1f} ms)" if fork else "in the loop")
        await self.store.sweep(kept)
        return manifest

    async def trim(self) -> int:
        """Trim the log to the retention horizon (module docstring); how many records went."""
        md, cfg = self.md, self.config
        kept = [int(i.split("-", 1)[0]) for i in pointer_ids(self._pointer)
                if i.endswith("-" + self.epoch[:8])]
        first, length = await self._bounds()
        if not kept or first == 0:
            return 0
        min_offset = await horizon(md, cfg, kept, first, length)
        if min_offset <= first:
            return 0
        num = await md.trim_log(min_offset)
        self.stats.num_trimmed += num
        log.info("log trimmed: %d records before offset %d dropped", num, min_offset)
        await self._bounds()
        return num

    async def _bounds(self) -> tuple[int, int]:
        first, length = await self.md.log_bounds()
        self.stats.first_offset, self.stats.log_length = first, length
        return first, length
