"""The host tier's read side and bookkeeping: engines, layouts, Lookup, Release, Stats, sweeps.

Lookups read memory only (no Redis, no await), so a Lookup is atomic with respect to every
other request. Writes that must be logged live in offloadd.tier.writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from events.state import CacheState
from offloadd.config import OffloaddConfig
from offloadd.errors import FailedPrecondition, InvalidArgument, NotFound
from offloadd.log.metadata import MetadataStore, RedisUnavailable
from offloadd.log.projection import EngineRecord
from offloadd.messages import (
    GroupHit,
    GroupQuery,
    LayoutStats,
    LookupOutcome,
    StoreStats,
)
from offloadd.tier.index import BlockState
from offloadd.tier.layouts import Layout, LayoutTable
from offloadd.tier.leases import LeaseTable, Reservation, now_ms, wall_ms_after

log = logging.getLogger(__name__)

DAEMON_SOURCE = "offloadd"
"""Source name of the daemon's own CPU-tier events in the log."""


@dataclass
class EngineInfo:
    engine_id: str
    incarnation: int
    model_namespace: str
    groups: dict[int, int]  # group_idx -> layout_id


class HostStore:
    def __init__(self, config: OffloaddConfig, metadata: MetadataStore, state: CacheState) -> None:
        self.config = config
        self.metadata = metadata
        self.state = state
        self.layouts = LayoutTable(config)
        self.engines: dict[str, EngineInfo] = {}
        self.leases = LeaseTable()
        self.daemon_incarnation = 0
        self.daemon_seq = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.corrupt: set[tuple[int, bytes]] = set()  # failed their checksum, removal pending
        self.unverified: list[tuple[int, bytes]] = []  # restored at start, not yet checked
        # Seeded from the wall clock (us): a restarted daemon never hands out a generation its
        # predecessor did (it would take a million assignments a second to catch up).
        self._last_generation = time.time_ns() // 1000

    def next_generation(self) -> int:
        """A new slot assignment's generation: daemon-wide, strictly increasing, never 0. An
        engine that read a slot it remembered checks the pin's answer against it."""
        self._last_generation += 1
        return self._last_generation

    # -- validation -----------------------------------------------------------------------

    def engine(self, engine_id: str) -> EngineInfo:
        info = self.engines.get(engine_id)
        if info is None:
            raise FailedPrecondition(f"engine {engine_id!r} is not registered; call RegisterEngine")
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

    def add_engine(self, rec: EngineRecord) -> None:
        self.engines[rec.engine_id] = EngineInfo(
            rec.engine_id, rec.incarnation, rec.model_namespace, dict(rec.groups)
        )

    # -- lookup and leases ----------------------------------------------------------------

    def lookup(
        self, engine_id: str, queries: list[GroupQuery], pin: bool, lease_ms: int
    ) -> LookupOutcome:
        engine = self.engine(engine_id)
        self.check_count(sum(len(q.block_hashes) for q in queries), "queries")
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
                or ((verify or not entry.verified) and not self._verify(layout, d))
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

    def _verify(self, layout: Layout, digest: bytes) -> bool:
        """Check a READY block's bytes; a mismatch takes it out of service (removal logged by
        the sweeper) unless someone holds a pin on it, in which case it only misses now."""
        entry = layout.index.entries[digest]
        if layout.checksum(entry.slot) == entry.checksum:
            layout.index.mark_verified(digest)
            return True
        log.error("checksum mismatch: layout %d slot %d", layout.layout_id, entry.slot)
        if entry.pins == 0:
            layout.index.mark_evicting(digest)
            self.corrupt.add((layout.layout_id, digest))
        return False

    async def verify_restored(self, batch: int = 2048) -> tuple[int, int]:
        """Background check of blocks restored at start and not yet looked up; returns
        (verified, failed). Yields to the loop between batches so serving goes on."""
        ok = failed = 0
        while self.unverified:
            for _ in range(min(batch, len(self.unverified))):
                layout_id, digest = self.unverified.pop()
                layout = self.layouts.by_id[layout_id]
                entry = layout.index.entries.get(digest)
                if entry is None or entry.verified or entry.state is not BlockState.READY:
                    continue
                if self._verify(layout, digest):
                    ok += 1
                else:
                    failed += 1
            await asyncio.sleep(0)
        return ok, failed

    def release(self, engine_id: str, lease_id: str) -> int:
        lease = self.leases.leases.get(lease_id)
        if lease is None:
            raise FailedPrecondition(f"lease {lease_id!r} is unknown or expired")
        if lease.engine_id != engine_id:
            raise FailedPrecondition(f"lease {lease_id!r} belongs to another engine")
        del self.leases.leases[lease_id]
        self._unpin(lease.blocks)
        return len(lease.blocks)

    def _unpin(self, blocks: list[tuple[int, bytes]]) -> None:
        for layout_id, digest in blocks:
            self.layouts.by_id[layout_id].index.unpin(digest)

    # -- expiry ---------------------------------------------------------------------------

    def expire(self) -> int:
        """Unpin expired leases and free expired reservations; returns how many expired."""
        now = now_ms()
        expired = self.leases.take_expired_leases(now)
        for lease in expired:
            self._unpin(lease.blocks)
        if self.metadata.is_in_doubt:
            return len(expired)  # a reservation may be committed by the write in doubt
        gone: list[Reservation] = []
        for res in list(self.leases.reservations.values()):
            if res.expires_ms <= now and not res.committing:
                gone.append(self.leases.reservations.pop(res.reservation_id))
        for res in gone:
            self.free_reservation(res)
        return len(expired) + len(gone)

    def free_reservation(self, res: Reservation) -> int:
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
    ) -> list[tuple[bytes, bytes, int]]:
        layout = self.layout_of(self.engine(engine_id), group_idx)
        self.check_count(len(hashes), "block_hashes")
        out: list[tuple[bytes, bytes, int]] = []
        for i, d in enumerate(hashes):
            self.check_digest(d, f"block_hashes[{i}]")
            entry = layout.index.ready(d)
            if entry is not None and not entry.verified and not self._verify(layout, d):
                entry = None
            if entry is None:
                raise NotFound(f"block_hashes[{i}] is not resident in group {group_idx}")
            out.append((d, layout.arena.read(entry.slot), entry.checksum))
        return out

    def stats(self) -> StoreStats:
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
