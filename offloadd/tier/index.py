"""The CPU tier of one layout in memory: digest -> slot entry, free slots, eviction order.

Pure bookkeeping, no I/O. The three collections (``entries``, ``free``, the policy's evictable
set) change together here and nowhere else. States: RESERVED (being copied in, invisible to
Lookup), READY (committed, readable), EVICTING (chosen as a victim, removal being logged).
Only READY blocks with no pins are evictable.

Every transition also keeps ``published[slot]`` (the arena's shared generation table, when
given) equal to the generation of the READY, verified block the slot serves, else 0: set on
commit, verification and a reverted eviction; cleared on choosing a victim, removal and
before a slot is handed to a writer.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from operator import attrgetter
from typing import Protocol

import msgspec

from offloadd.tier.eviction import ArcPolicy, LruPolicy

# Slots (or restored entries) a step of LayoutIndex.settle_steps works through: ~2 ms.
SETTLE_STEP = 25_000


class GenerationTable(Protocol):
    """Where each slot's servable generation is published (offloadd.slot_generations.SlotGenerations)."""

    def __setitem__(self, slot: int, generation: int) -> None: ...

    def set_many(self, items: Iterable[tuple[int, int]]) -> None: ...

    def is_clear(self) -> bool: ...


class BlockState(enum.Enum):
    RESERVED = "reserved"
    READY = "ready"
    EVICTING = "evicting"


class SlotEntry(msgspec.Struct, gc=False):
    """One block of the tier. A msgspec struct, not a dataclass: recovery makes 100k of them
    (decoded in C straight from the projection's rows, RestoredEntry), and ``gc=False`` keeps
    them out of the collector's view (its fields are bytes, str, ints and a tuple of ints: it
    can be in no reference cycle). Its first seven fields are a projection row's
    (offloadd.log.projection.ProjectedBlock), in the row's order."""

    slot: int
    group_idx: int
    checksum: int  # xxh3-64 of the block's bytes; 0 until committed
    parent: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: bytes  # canonical CBOR as the engine sent it; b"" for none
    lora_name: str | None
    state: BlockState = BlockState.READY
    owner: str = ""  # the reservation id while RESERVED
    pins: int = 0
    verified: bool = True  # False after a restart until its bytes were checked against checksum
    generation: int = 0  # this assignment of the slot (HostStore.next_generation); 0: none


class RestoredEntry(SlotEntry, array_like=True, gc=False):
    """A projection row decoded as an entry (offloadd.log.log_reads.read_rows): READY, not
    verified yet, its generation given by recovery. Only a row of exactly the seven projection
    fields may be decoded as one (read_rows checks each row's msgpack header): a longer array
    would fill the fields after them."""

    verified: bool = False


class LayoutIndex:
    def __init__(self, policy: LruPolicy | ArcPolicy, published: GenerationTable | None = None) -> None:
        self.published = published
        self.entries: dict[bytes, SlotEntry] = {}
        self._free: list[int] | None = []  # None: to be worked out from entries (free)
        self.num_slots = 0
        self._policy = policy
        self._unordered: list[bytes] = []  # restored blocks not yet in the eviction order
        self._restores = 0  # rebuild_free calls: a free list worked out before one is stale
        self.num_ready = 0
        self.num_reserved = 0
        self.num_pinned = 0
        self.lost: set[int] = set()  # reserved slots whose bytes a resized arena file lost

    # -- capacity -------------------------------------------------------------------------

    def grow(self, n: int) -> None:
        """``n`` new slots (a new chunk) become free."""
        new = range(self.num_slots, self.num_slots + n)
        self.free[:0] = reversed(new)  # below the existing free slots: used after them
        self.num_slots += n

    def take_free_slot(self) -> int | None:
        free = self.free
        return free.pop() if free else None

    @property
    def policy(self) -> LruPolicy | ArcPolicy:
        """The eviction order of the evictable blocks. A restore's blocks join it on first use
        (:meth:`settle` right after SERVING, or the first request that needs it): ordering
        100k keys is ~20 ms a restart need not wait for."""
        if self._unordered:
            keys, self._unordered = self._unordered, []
            self._policy.add_many(keys)
        return self._policy

    @property
    def free(self) -> list[int]:
        """The free slots, popped from the end: lowest slot first. After a restore, the
        slots no entry holds, worked out on first use (:meth:`rebuild_free`)."""
        if self._free is None:
            used = set(map(attrgetter("slot"), self.entries.values()))
            self._free = [s for s in reversed(range(self.num_slots)) if s not in used]
        return self._free

    # -- queries --------------------------------------------------------------------------

    def get(self, digest: bytes) -> SlotEntry | None:
        return self.entries.get(digest)

    def entry(self, digest: bytes) -> SlotEntry:
        """The entry of a block known to be present (KeyError otherwise)."""
        return self.entries[digest]

    @property
    def num_free(self) -> int:
        return len(self.free)

    def count_missing(self, digests: list[bytes]) -> int:
        """How many of ``digests`` have no entry (need a slot); READY ones count as wanted
        again, so they are touched and cannot be chosen as victims of the same request."""
        missing = 0
        for d in digests:
            entry = self.entries.get(d)
            if entry is None:
                missing += 1
            elif entry.state is BlockState.READY:
                self.policy.touch(d)
        return missing

    def touch(self, digest: bytes) -> None:
        self.policy.touch(digest)

    def is_lost(self, slot: int) -> bool:
        """The slot's bytes were lost while it was reserved: its commit must fail."""
        return slot in self.lost

    def ready(self, digest: bytes) -> SlotEntry | None:
        entry = self.entries.get(digest)
        return entry if entry is not None and entry.state is BlockState.READY else None

    # -- transitions ----------------------------------------------------------------------

    @staticmethod
    def _servable(entry: SlotEntry) -> int:
        """The generation to publish for the entry's slot: 0 unless READY and verified."""
        ok = entry.state is BlockState.READY and entry.verified
        return entry.generation if ok else 0

    def _publish(self, entry: SlotEntry) -> None:
        if self.published is not None:
            self.published[entry.slot] = self._servable(entry)

    def _retract(self, slot: int) -> None:
        if self.published is not None:
            self.published[slot] = 0

    def reserve(self, digest: bytes, slot: int, entry_fields: SlotEntry) -> None:
        assert digest not in self.entries, "reserve of a present block"
        self._retract(slot)  # before anyone may write the slot
        self.lost.discard(slot)
        entry_fields.slot = slot
        entry_fields.state = BlockState.RESERVED
        self.entries[digest] = entry_fields
        self.num_reserved += 1

    def unreserve(self, digest: bytes) -> None:
        """Abort or lease expiry: the slot is free again, nothing was visible."""
        free = self.free  # before the entry goes: a free list made after would hold its slot
        entry = self.entries.pop(digest)
        assert entry.state is BlockState.RESERVED
        self.num_reserved -= 1
        self._retract(entry.slot)
        free.append(entry.slot)

    def commit(self, digest: bytes, checksum: int) -> None:
        entry = self.entries[digest]
        assert entry.state is BlockState.RESERVED
        entry.state = BlockState.READY
        entry.checksum = checksum
        entry.owner = ""
        self.num_reserved -= 1
        self.num_ready += 1
        self.policy.add(digest)
        self._publish(entry)

    def insert_ready(self, entries: dict[bytes, SlotEntry]) -> None:
        """Recovery: committed blocks at known slots, READY (the caller's promise: recovery
        makes 100k of them, each checked would cost a pass), then :meth:`rebuild_free`.
        Published with one write for all; an unverified one (every restored block) publishes
        0, which a table still clear since it was made (a restart's) already holds."""
        self.entries.update(entries)
        self.num_ready += len(entries)
        self._unordered.extend(entries)  # into the policy on its first use
        if self.published is None:
            return
        servable = [(e.slot, e.generation) for e in entries.values() if e.verified]
        if len(servable) < len(entries) and not self.published.is_clear():
            self.published.set_many((e.slot, self._servable(e)) for e in entries.values())
        elif servable:
            self.published.set_many(servable)

    def mark_verified(self, digest: bytes) -> None:
        """Its bytes matched its checksum: a READY block becomes servable without asking."""
        entry = self.entries[digest]
        entry.verified = True
        self._publish(entry)

    def mark_verified_many(self, digests: list[bytes]) -> None:
        """:meth:`mark_verified` for many, published with one write of the table."""
        entries = [self.entries[d] for d in digests]
        for entry in entries:
            entry.verified = True
        if self.published is not None:
            self.published.set_many((e.slot, self._servable(e)) for e in entries)

    def mark_unverified(self, digest: bytes) -> None:
        """Its bytes may be gone: not servable until checked again."""
        entry = self.entries[digest]
        entry.verified = False
        self._publish(entry)

    def mark_lost(self, digest: bytes) -> None:
        """A RESERVED block's bytes were lost (its arena file was resized): its commit fails."""
        entry = self.entries[digest]
        assert entry.state is BlockState.RESERVED
        self.lost.add(entry.slot)

    def rebuild_free(self) -> None:
        """Recovery: the free list is worked out again on its first use, once serving has
        started (:meth:`settle_steps`, or the first Reserve): ~20-40 ms for 100k blocks.
        Every method that takes or frees a slot reads ``free`` before it changes ``entries``."""
        self._free = None
        self._restores += 1

    def settle(self) -> None:
        """What a restore left to first use (free list, eviction order), worked out now."""
        _ = self.free, self.policy

    def settle_steps(self, step: int = SETTLE_STEP) -> Iterator[None]:
        """:meth:`settle` in steps, yielding between them so that requests are served in
        between (right after a restart's SERVING, when its clients come back). The eviction
        order is one step (``OrderedDict.fromkeys``, ~15-20 ms for 100k; in slices it would
        cost 3-4x); the free list is made ``step`` entries, then ``step`` slots at a time.
        A request that needs either meanwhile works it out whole itself (the properties), and
        then the steps stop: as every method that takes or frees a slot reads ``free`` first,
        a free list still unmade at the last step means the slots held have not changed."""
        if self._unordered:
            _ = self.policy
            yield
        if self._free is not None:
            return
        restores = self._restores
        held = list(self.entries.values())
        used: set[int] = set()
        for start in range(0, len(held), step):
            used.update(map(attrgetter("slot"), held[start:start + step]))
            yield
            if self._free is not None or self._restores != restores:
                return
        free: list[int] = []
        for top in range(self.num_slots, 0, -step):  # highest first: popped from the end
            free.extend(s for s in range(top - 1, max(top - step, 0) - 1, -1) if s not in used)
            yield
            if self._free is not None or self._restores != restores:
                return
        self._free = free

    def pin(self, digest: bytes) -> None:
        entry = self.entries[digest]
        assert entry.state is BlockState.READY
        if entry.pins == 0:
            self.policy.remove(digest)
            self.num_pinned += 1
        entry.pins += 1

    def unpin(self, digest: bytes) -> None:
        entry = self.entries.get(digest)
        if entry is None or entry.pins == 0:
            return
        entry.pins -= 1
        if entry.pins == 0:
            self.num_pinned -= 1
            if entry.state is BlockState.READY:
                self.policy.add(digest)

    def choose_victims(self, n: int) -> list[bytes]:
        """Mark up to ``n`` evictable blocks EVICTING (invisible, unpinnable) and return them."""
        victims = self.policy.victims(n)
        for digest in victims:
            self.policy.remove(digest)
            entry = self.entries[digest]
            entry.state = BlockState.EVICTING
            self._retract(entry.slot)
            self.num_ready -= 1
        return victims

    def mark_evicting(self, digest: bytes) -> None:
        """Take one READY, unpinned block out of service ahead of its logged removal."""
        entry = self.entries[digest]
        assert entry.state is BlockState.READY and entry.pins == 0
        self.policy.remove(digest)
        entry.state = BlockState.EVICTING
        self._retract(entry.slot)
        self.num_ready -= 1

    def restore(self, digests: list[bytes]) -> None:
        """The removal of these victims was not logged: they are READY again."""
        for digest in digests:
            entry = self.entries[digest]
            assert entry.state is BlockState.EVICTING
            entry.state = BlockState.READY
            self.num_ready += 1
            self.policy.add(digest)
            self._publish(entry)

    def remove(self, digest: bytes) -> SlotEntry:
        """The block left the tier (its removal is logged): free its slot."""
        free = self.free  # before the entry goes (unreserve)
        entry = self.entries.pop(digest)
        if entry.state is BlockState.READY:
            self.num_ready -= 1
            self.policy.remove(digest)
        elif entry.state is BlockState.RESERVED:
            self.num_reserved -= 1
        if entry.pins:
            self.num_pinned -= 1
        self.policy.evicted(digest)
        self._retract(entry.slot)
        free.append(entry.slot)
        return entry
