"""The host tier's logged writes: Reserve (with eviction), Commit, Abort, corrupt-block drops.

A block becomes readable only after the MULTI/EXEC carrying its ``BlockStored(CPU)`` succeeded;
a victim's slot is reused only after its ``BlockRemoved(CPU)`` did. Reserve and Abort log
nothing. The daemon's own events carry source ``offloadd`` with the daemon's incarnation.

Reserve answers per block: RESERVED (slot), ALREADY_STORED, IN_FLIGHT (being stored or being
evicted) or NO_SPACE. When at least one block needed a slot and none could be had (no free
slot, no chunk left to create, every block pinned or reserved), the whole call fails with
RESOURCE_EXHAUSTED instead. Eviction is per layout: a layout never takes slots of another.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from events.hashing import to_wire
from events.schema import BlockRemoved, BlockStored, Event, LogRecord
from offloadd.codec import decode_extra_keys
from offloadd.errors import InvalidArgument, ResourceExhausted
from offloadd.log import projection
from offloadd.log.metadata import Append
from offloadd.log.projection import Pipe, ProjectedBlock
from offloadd.messages import BlockToStore, CommitOutcome, ReserveOutcome, ReserveStatus
from offloadd.tier.index import BlockState, SlotEntry
from offloadd.tier.layouts import Layout
from offloadd.tier.leases import Reservation, wall_ms_after
from offloadd.tier.source import DAEMON_SOURCE
from offloadd.tier.store import HostStore


class StoreWriter:
    def __init__(self, store: HostStore) -> None:
        self.store = store
        self._reserve_lock = asyncio.Lock()

    # -- Reserve --------------------------------------------------------------------------

    async def reserve(
        self, engine_id: str, group_idx: int, blocks: list[BlockToStore], lease_ms: int,
        lora_name: str | None,
    ) -> ReserveOutcome:
        store = self.store
        layout = store.layout_of(store.engine(engine_id), group_idx)
        self._validate(layout, blocks)
        async with self._reserve_lock:  # eviction then allocation, without a rival in between
            need = layout.index.count_missing([b.block_hash for b in blocks])
            short = store.grow_for(layout, need)
            if short > 0:
                await self.evict(layout, short)
            return self._allocate(layout, blocks, store.lease_ms(lease_ms), engine_id, lora_name)

    def _validate(self, layout: Layout, blocks: list[BlockToStore]) -> None:
        store = self.store
        store.check_count(len(blocks), "blocks")
        bs = layout.record.block_size
        seen: set[bytes] = set()
        for i, b in enumerate(blocks):
            store.check_digest(b.block_hash, f"blocks[{i}].block_hash")
            if b.parent_block_hash is not None:
                store.check_digest(b.parent_block_hash, f"blocks[{i}].parent_block_hash")
            if len(b.token_ids) != bs:
                raise InvalidArgument(
                    f"blocks[{i}].token_ids: expected {bs} ids (block_size), got {len(b.token_ids)}"
                )
            if b.block_hash in seen:
                raise InvalidArgument(f"blocks[{i}].block_hash: duplicate in this request")
            seen.add(b.block_hash)
            decode_extra_keys(b.extra_keys, f"blocks[{i}].extra_keys")

    def _allocate(
        self, layout: Layout, blocks: list[BlockToStore], ms: int, engine_id: str,
        lora_name: str | None,
    ) -> ReserveOutcome:
        index = layout.index
        res: Reservation | None = None
        out: list[tuple[ReserveStatus, int]] = []
        generations: list[int] = []
        for b in blocks:
            generations.append(0)
            entry = index.get(b.block_hash)
            if entry is not None:
                if entry.state is BlockState.READY:
                    index.touch(b.block_hash)
                    out.append((ReserveStatus.ALREADY_STORED, -1))
                else:
                    out.append((ReserveStatus.IN_FLIGHT, -1))
                continue
            slot = index.take_free_slot()
            if slot is None:
                out.append((ReserveStatus.NO_SPACE, -1))
                continue
            if res is None:
                res = self.store.new_reservation(engine_id, layout, lora_name, ms)
            generations[-1] = self.store.source.next_generation()
            index.reserve(b.block_hash, slot, SlotEntry(
                slot=slot, group_idx=layout.record.group_idx, checksum=0,
                parent=b.parent_block_hash, token_ids=tuple(b.token_ids), extra_keys=b.extra_keys,
                lora_name=lora_name, state=BlockState.RESERVED, owner=res.reservation_id,
                generation=generations[-1],
            ))
            res.digests.append(b.block_hash)
            out.append((ReserveStatus.RESERVED, slot))
        if res is None and any(s is ReserveStatus.NO_SPACE for s, _ in out):
            raise ResourceExhausted(
                f"no free slot in layout {layout.layout_id} and every block is pinned or reserved"
            )
        if res is None:
            return ReserveOutcome("", tuple(out), 0, tuple(generations))
        return ReserveOutcome(res.reservation_id, tuple(out), wall_ms_after(ms), tuple(generations))

    # -- eviction -------------------------------------------------------------------------

    async def evict(self, layout: Layout, n: int) -> int:
        victims = layout.index.choose_victims(n)
        if victims:
            await self._log_removal(layout, victims, count_as_eviction=True)
        return len(victims)

    async def _log_removal(self, layout: Layout, digests: list[bytes], count_as_eviction: bool) -> None:
        store = self.store
        event = BlockRemoved(tuple(to_wire(d) for d in digests), "CPU", layout.record.group_idx)
        key = store.metadata.keys.blocks(layout.layout_id)

        def project(pipe: Pipe) -> None:
            pipe.hdel(key, *digests)

        def apply(record: LogRecord) -> None:
            store.source.logged(record)
            for d in digests:
                layout.index.remove(d)
            if count_as_eviction:
                store.count_evictions(len(digests))

        await store.metadata.append(Append(
            DAEMON_SOURCE, store.source.incarnation, store.source.next_seq, (event,), project, apply,
            # A failed eviction makes its victims READY again; corrupt blocks stay out of
            # service and are retried by the sweeper.
            revert=(lambda: layout.index.restore(digests)) if count_as_eviction else (lambda: None),
        ))

    async def drop_corrupt(self) -> None:
        """Log the removal of blocks that failed their checksum on load."""
        store = self.store
        for layout_id, digests in store.integrity.corrupt_by_layout().items():
            await self._log_removal(store.layout(layout_id), digests, count_as_eviction=False)
            store.integrity.forget_corrupt(layout_id, digests)

    # -- Commit / Abort -------------------------------------------------------------------

    async def commit(self, engine_id: str, reservation_id: str, subset: list[bytes],
                     checksums: Mapping[bytes, int] | None = None) -> CommitOutcome:
        """``checksums``: the blocks' xxh3 as the daemon computed them on the bytes it wrote
        itself (a fill from a peer); the slots engines wrote are read back and hashed here."""
        store = self.store
        await store.metadata.resolve()  # a retried Commit must see how the last attempt ended
        res = store.reservation(engine_id, reservation_id)
        wanted = set(subset)
        for i, d in enumerate(subset):
            if d not in res.digests:
                raise InvalidArgument(f"block_hashes[{i}] is not part of reservation {reservation_id!r}")
        chosen = [d for d in res.digests if not wanted or d in wanted]
        rest = [d for d in res.digests if wanted and d not in wanted]
        layout = store.layout(res.layout_id)
        entries = {d: layout.index.entry(d) for d in chosen}
        sums = {d: layout.checksum(e.slot) if checksums is None or layout.index.is_lost(e.slot)
                else checksums[d] for d, e in entries.items()}
        events = stored_events(layout, res.lora_name, chosen, entries, res.provenance)
        blocks_key = store.metadata.keys.blocks(layout.layout_id)
        layouts_key = store.metadata.keys.layouts
        group = layout.record.group_idx

        def project(pipe: Pipe) -> None:
            pipe.hset(blocks_key, mapping={
                d: projection.encode(ProjectedBlock(
                    e.slot, group, sums[d], e.parent, e.token_ids, e.extra_keys, e.lora_name,
                ))
                for d, e in entries.items()
            })
            pipe.hset(layouts_key, layout.record.identity, projection.encode(layout.record))

        def apply(record: LogRecord) -> None:
            store.source.logged(record)
            for d in chosen:
                layout.index.commit(d, sums[d])
            for d in rest:
                layout.index.unreserve(d)
            store.close_reservation(reservation_id)

        def revert() -> None:
            res.committing = False

        res.committing = True
        try:
            record = await store.metadata.append(Append(
                DAEMON_SOURCE, store.source.incarnation, store.source.next_seq, tuple(events), project,
                apply, revert,
            ))
        finally:
            if not store.metadata.is_in_doubt:
                res.committing = False
        return CommitOutcome(len(chosen), record.offset)

    def abort(self, engine_id: str, reservation_id: str) -> int:
        return self.store.abort_reservation(self.store.reservation(engine_id, reservation_id))


def stored_events(
    layout: Layout, lora_name: str | None, chosen: list[bytes], entries: dict[bytes, SlotEntry],
    provenance: str | None = None,
) -> list[Event]:
    """BlockStored(CPU) events, one per run of consecutive blocks of one chain."""
    rec = layout.record
    window = rec.sliding_window if rec.kind == "sliding_window" else None
    runs: list[list[bytes]] = []
    for d in chosen:
        if runs and entries[d].parent == runs[-1][-1]:
            runs[-1].append(d)
        else:
            runs.append([d])
    events: list[Event] = []
    for run in runs:
        head = entries[run[0]]
        keys = [decode_extra_keys(entries[d].extra_keys, "extra_keys") for d in run]
        events.append(BlockStored(
            block_hashes=tuple(to_wire(d) for d in run),
            parent_block_hash=None if head.parent is None else to_wire(head.parent),
            token_ids=tuple(t for d in run for t in entries[d].token_ids),
            block_size=rec.block_size,
            medium="CPU",
            group_idx=rec.group_idx,
            kv_cache_spec_kind="sliding_window" if window is not None else "full_attention",
            sliding_window=window,
            lora_name=lora_name,
            extra_keys=None if all(k is None for k in keys) else tuple(keys),
            provenance=provenance,
        ))
    return events
