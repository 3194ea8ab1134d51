"""The host tier's owner: engines, layouts, leases, reservations, the daemon's log position;
and its read side: Lookup, Release, ReadBlocks, Stats, expiry sweeps.

Lookups read memory only (no Redis, no await), so a Lookup is atomic with respect to every
other request. Writes that must be logged (offloadd.tier.writes), registration
(offloadd.tier.registration) and recovery (offloadd.log.recovery) change the tier only through
HostStore's methods; per-layout slot state changes only through its LayoutIndex's transitions.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from events.state import CacheState
from offloadd.arena import ArenaGeometry
from offloadd.config import OffloaddConfig
from offloadd.errors import FailedPrecondition, InvalidArgument, NotFound, NotRegistered
from offloadd.log.metadata import MetadataStore, RedisUnavailable
from offloadd.log.projection import EngineRecord, LayoutRecord
from offloadd.messages import (
    BlockData,
    GroupHit,
    GroupQuery,
    LayoutStats,
    LookupOutcome,
    StoreStats,
)
from offloadd.tier.index import BlockState, SlotEntry
from offloadd.tier.integrity import Integrity
from offloadd.tier.layouts import Layout, LayoutTable
from offloadd.tier.leases import LeaseTable, Reservation, now_ms, wall_ms_after
from offloadd.tier.source import DaemonSource

ARENA_CHECK_INTERVAL_S = 0.05
"""How stale Lookup and ReadBlocks may find the arena files' sizes (each check is one fstat a
chunk file); the sweep and Stats check every time."""


@dataclass
class EngineInfo:
    engine_id: str
    incarnation: int
    model_namespace: str
    groups: dict[int, int]  # group_idx -> layout_id


class HostStore:
    """The one owner of the host tier's state. Its tables (``layouts``, ``engines``,
    ``leases``) and counters are readable (metrics, stats); they change only through methods."""

    def __init__(self, config: OffloaddConfig, metadata: MetadataStore, state: CacheState) -> None:
        self.config = config
        self.metadata = metadata
        self.state = state
        self.layouts = LayoutTable(config)
        self.engines: dict[str, EngineInfo] = {}
        self.leases = LeaseTable()
        self.source = DaemonSource()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.integrity = Integrity(self.layouts)
        self._arena_checked_s = 0.0

    # -- validation -----------------------------------------------------------------------

    def engine(self, engine_id: str) -> EngineInfo:
        info = self.engines.get(engine_id)
        if info is None:
            raise NotRegistered(f"engine {engine_id!r} is not registered; call RegisterEngine")
        return info

    def layout_of(self, engine: EngineInfo, group_idx: int) -> Layout:
        layout_id = engine.groups.get(group_idx)
        if layout_id is None:
            raise InvalidArgument(
                f"group_idx {group_idx} is not registered for engine {engine.engine_id!r} "
                f"(registered: {sorted(engine.groups)})"
            )
        return self.layouts.by_id[layout_id]

    def check_digest(self, digest: bytes, what: str) -> None:
        want = self.config.digest_bytes
        if len(digest) != want:
            raise InvalidArgument(
                f"{what}: hash is {len(digest)} bytes, expected {want} ({self.config.hash_algo})"
            )

    def check_count(self, n: int, what: str) -> None:
        if n > self.config.max_request_hashes:
            raise InvalidArgument(
                f"{what}: {n} entries exceed the limit of {self.config.max_request_hashes}"
            )

    def lease_ms(self, requested: int) -> int:
        return min(requested or self.config.lease_ms, self.config.max_lease_ms)

    # -- layouts and engines ---------------------------------------------------------------

    def add_engine(self, rec: EngineRecord) -> None:
        self.engines[rec.engine_id] = EngineInfo(
            rec.engine_id, rec.incarnation, rec.model_namespace, dict(rec.groups)
        )

    def layout(self, layout_id: int) -> Layout:
        return self.layouts.by_id[layout_id]

    def all_layouts(self) -> list[Layout]:
        return list(self.layouts.by_id.values())

    def layout_with(self, identity: str) -> Layout | None:
        """The registered layout of this identity (LayoutRecord.identity), if any."""
        layout_id = self.layouts.by_identity.get(identity)
        return None if layout_id is None else self.layouts.by_id[layout_id]

    def layout_named(self, name: str) -> Layout | None:
        """The registered layout of this name (layouts.layout_name), if any."""
        layout_id = self.layouts.by_name.get(name)
        return None if layout_id is None else self.layouts.by_id[layout_id]

    def drop_engine_claims(self, engine_id: str) -> int:
        """A new incarnation registered: the old one's pins are released and its reservations
        freed (a reservation being committed is left to its commit; with a write in doubt,
        expiry frees them later). Returns how many leases and reservations were dropped."""
        leases = [lease for lease in self.leases.leases.values() if lease.engine_id == engine_id]
        for lease in leases:
            self.leases.drop_lease(lease.lease_id)
            self._unpin(lease.blocks)
        if self.metadata.is_in_doubt:
            return len(leases)
        gone = [r for r in self.leases.reservations.values()
                if r.engine_id == engine_id and not r.committing]
        for res in gone:
            self.abort_reservation(res)
        return len(leases) + len(gone)

    def next_layout_id(self) -> int:
        return self.layouts.next_id()

    def geometry_for(self, layout_id: int, block_bytes: int) -> ArenaGeometry:
        """A new layout's arena geometry; ValueError if a block cannot fit the capacity."""
        return self.layouts.geometry_for(layout_id, block_bytes)

    def add_layout(self, record: LayoutRecord) -> Layout:
        """Add a layout (new, or recovered with its chunk files) unless it is known already."""
        known = self.layouts.by_id.get(record.layout_id)
        return known if known is not None else self.layouts.add(record)

    def grow_for(self, layout: Layout, need: int) -> int:
        """Create chunk files until ``need`` slots are free or the capacity is used; returns
        how many slots are still missing (to be had by eviction)."""
        while layout.index.num_free < need and self.layouts.can_grow(layout):
            self.layouts.grow(layout)
        return max(0, need - layout.index.num_free)

    def restore(self, layout: Layout, entries: dict[bytes, SlotEntry]) -> None:
        """Recovery: committed blocks back at their slots, READY but unverified (checked by
        Integrity.verify_restored or by the first Lookup/ReadBlocks that would return them)."""
        layout.index.insert_ready(entries)
        layout.index.rebuild_free()
        self.integrity.add_unverified(layout.layout_id, list(entries))

    def check_arena(self, *, at_most_every_s: float = 0.0) -> int:
        """Find arena files another process resized (reported, repaired, their lost blocks out
        of service, removal logged by the sweeper); returns how many blocks were lost."""
        now = time.monotonic()
        if now - self._arena_checked_s < at_most_every_s:
            return 0
        self._arena_checked_s = now
        return self.integrity.check_all()

    def count_evictions(self, n: int) -> None:
        self.evictions += n

    def close(self) -> None:
        self.layouts.close()

    # -- lookup and leases ----------------------------------------------------------------

    def lookup(
        self, engine_id: str, queries: list[GroupQuery], pin: bool, lease_ms: int
    ) -> LookupOutcome:
        engine = self.engine(engine_id)
        self.check_count(sum(len(q.block_hashes) for q in queries), "queries")
        self.check_arena(at_most_every_s=ARENA_CHECK_INTERVAL_S)
        resolved: list[tuple[Layout, GroupQuery]] = []
        want = self.config.digest_bytes
        for qi, q in enumerate(queries):
            layout = self.layout_of(engine, q.group_idx)
            if any(len(d) != want for d in q.block_hashes):  # the hot path checks in C
                for hi, d in enumerate(q.block_hashes):
                    self.check_digest(d, f"queries[{qi}].block_hashes[{hi}]")
            resolved.append((layout, q))
        pinned: list[tuple[int, bytes]] = []
        results = [self._lookup_group(layout, q, pin, pinned) for layout, q in resolved]
        if not pinned:
            return LookupOutcome(tuple(results), "", 0)
        ms = self.lease_ms(lease_ms)
        lease = self.leases.new_lease(engine_id, ms, pinned)
        return LookupOutcome(tuple(results), lease.lease_id, wall_ms_after(ms))

    def _lookup_group(
        self, layout: Layout, q: GroupQuery, pin: bool, pinned: list[tuple[int, bytes]]
    ) -> GroupHit:
        index = layout.index
        entries, touch, ready = index.entries, index.policy.touch, BlockState.READY
        verify = self.config.verify_on_load
        slots: list[int] = []
        generations: list[int] = []
        num_prefix = 0
        in_prefix = True
        for d in q.block_hashes:
            entry = entries.get(d)
            if entry is not None and (
                entry.state is not ready
                or ((verify or not entry.verified) and not self.integrity.verify(layout, d))
            ):
                entry = None
            if entry is None:
                slots.append(-1)
                generations.append(0)
                self.misses += 1
                in_prefix = False
                if q.prefix_only:
                    break
                continue
            slots.append(entry.slot)
            generations.append(entry.generation)
            self.hits += 1
            num_prefix += in_prefix
            touch(d)
            if pin:
                index.pin(d)
                pinned.append((layout.layout_id, d))
        return GroupHit(q.group_idx, num_prefix, tuple(slots), tuple(generations))

    def release(self, engine_id: str, lease_id: str) -> int:
        lease = self.leases.get_lease(lease_id)
        if lease is None:
            raise FailedPrecondition(f"lease {lease_id!r} is unknown or expired")
        if lease.engine_id != engine_id:
            raise FailedPrecondition(f"lease {lease_id!r} belongs to another engine")
        self.leases.drop_lease(lease_id)
        self._unpin(lease.blocks)
        return len(lease.blocks)

    def _unpin(self, blocks: list[tuple[int, bytes]]) -> None:
        for layout_id, digest in blocks:
            self.layouts.by_id[layout_id].index.unpin(digest)

    # -- expiry ---------------------------------------------------------------------------

    def expire(self) -> int:
        """Unpin expired leases and free expired reservations; returns how many expired. (The
        periodic sweep: arena files are checked here too.)"""
        self.check_arena()
        now = now_ms()
        expired = self.leases.take_expired_leases(now)
        for lease in expired:
            self._unpin(lease.blocks)
        if self.metadata.is_in_doubt:
            return len(expired)  # a reservation may be committed by the write in doubt
        gone = self.leases.take_expired_reservations(now)
        for res in gone:
            self._free_reservation(res)
        return len(expired) + len(gone)

    # -- reservations -----------------------------------------------------------------------

    def new_reservation(
        self, engine_id: str, layout: Layout, lora_name: str | None, ms: int
    ) -> Reservation:
        return self.leases.new_reservation(
            engine_id, layout.layout_id, layout.record.group_idx, lora_name, ms
        )

    def reservation(self, engine_id: str, reservation_id: str) -> Reservation:
        """The engine's open reservation, not being committed; FailedPrecondition otherwise."""
        self.engine(engine_id)
        res = self.leases.get_reservation(reservation_id)
        if res is None:
            raise FailedPrecondition(f"reservation {reservation_id!r} is unknown or expired")
        if res.engine_id != engine_id:
            raise FailedPrecondition(f"reservation {reservation_id!r} belongs to another engine")
        if res.committing:
            raise FailedPrecondition(f"reservation {reservation_id!r} is being committed")
        return res

    def close_reservation(self, reservation_id: str) -> None:
        """Its commit is logged: the blocks it reserved are READY (or freed) already."""
        self.leases.drop_reservation(reservation_id)

    def abort_reservation(self, res: Reservation) -> int:
        """Drop the reservation and free its slots; returns how many were freed."""
        self.leases.drop_reservation(res.reservation_id)
        return self._free_reservation(res)

    def _free_reservation(self, res: Reservation) -> int:
        index = self.layouts.by_id[res.layout_id].index
        n = 0
        for d in res.digests:
            entry = index.entries.get(d)
            if entry is not None and entry.owner == res.reservation_id:
                index.unreserve(d)
                n += 1
        return n

    # -- read side ------------------------------------------------------------------------

    def read_blocks(
        self, engine_id: str, group_idx: int, hashes: list[bytes]
    ) -> list[BlockData]:
        layout = self.layout_of(self.engine(engine_id), group_idx)
        self.check_count(len(hashes), "block_hashes")
        self.check_arena(at_most_every_s=ARENA_CHECK_INTERVAL_S)
        out: list[BlockData] = []
        for i, d in enumerate(hashes):
            self.check_digest(d, f"block_hashes[{i}]")
            entry = layout.index.ready(d)
            if entry is not None and not entry.verified and not self.integrity.verify(layout, d):
                entry = None
            data = None if entry is None else layout.read(entry.slot)
            if entry is None or data is None:
                if entry is not None:
                    self.integrity.check_files(layout)  # its file shrank since it was checked
                raise NotFound(f"block_hashes[{i}] is not resident in group {group_idx}")
            out.append(BlockData(d, data, entry.checksum, entry.parent, entry.token_ids,
                                 entry.extra_keys, entry.lora_name))
        return out

    def stats(self) -> StoreStats:
        self.check_arena()
        layouts = tuple(
            LayoutStats(
                lay.layout_id, lay.geometry.slot_bytes, lay.index.num_slots, lay.index.num_ready,
                lay.index.num_reserved, lay.index.num_pinned,
            )
            for lay in self.layouts.by_id.values()
        )
        return StoreStats(
            capacity_bytes=self.config.capacity_bytes,
            used_bytes=sum(s.num_ready * s.slot_bytes for s in layouts),
            num_blocks=sum(s.num_ready for s in layouts),
            hits=self.hits, misses=self.misses, evictions=self.evictions,
            log_offset=self.metadata.head, layouts=layouts, num_engines=len(self.engines),
        )

    async def resolve_quietly(self) -> None:
        with contextlib.suppress(RedisUnavailable):
            await self.metadata.resolve()
