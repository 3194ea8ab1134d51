"""What this engine knows of the host tier: where its blocks sit, to load them without asking.

A pinning Lookup before a CPU-tier hit's first copy is a gRPC round trip on the hit's critical
path (DECISIONS 20-22 say what it cost). The engine knows where most of its hits sit: it stored
them itself (each Reserve answers a slot and that assignment's *generation*) and earlier
lookups answered more. The daemon publishes, in a table in shared memory beside the arena, the
generation of the block each slot serves now (0 for none: offloadd.arena ``SlotGenerations``).
A generation names one assignment of a slot and is never reused. So the connector loads from
the view with no RPC at all (engine.offload.loads, DECISIONS 22):

- before the copies, it keeps only the view's entries whose slot still shows their generation
  (a stale entry is simply not used: the request asks first);
- after the copies completed, before the step's result is used (``check_loads``), every slot
  read must still show the same generation: then no slot was given away (or taken out of
  service) while it was read, and every byte read was the block's own. Otherwise that
  request's step is dropped and it is admitted again, asking first.

Nothing is pinned, so an eviction during the copy is possible; it is caught by the second check
and costs one wasted step of one request. The daemon hears of the hit afterwards, through a
Lookup without a pin sent by the connector's worker (its LRU order). Bounded by the daemon's
slots (no more entries can be right): least recently learned entries go first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.kv_cache import KVCacheGroup
from engine.offload.lookup import GroupHitInput, hit_length
from offloadd.client import GroupQuery


class TierView:
    """Per group, offloaded-block key -> (slot, generation). Thread-safe: the connector's
    worker learns commits while the engine thread reads."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._groups: dict[int, OrderedDict[bytes, tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(g) for g in self._groups.values())

    def learn(self, group_idx: int, keys: Sequence[bytes], slots: Sequence[int],
              generations: Sequence[int]) -> None:
        """Remember where the daemon said these blocks are; a slot < 0 or a generation of 0
        (not found, or a daemon that does not send generations) forgets the key."""
        if not (len(keys) == len(slots) == len(generations)):
            raise ValueError(f"{len(keys)} keys, {len(slots)} slots, {len(generations)} generations")
        with self._lock:
            table = self._groups.setdefault(group_idx, OrderedDict())
            for key, slot, gen in zip(keys, slots, generations, strict=True):
                if slot < 0 or gen <= 0:
                    table.pop(key, None)
                    continue
                table[key] = (slot, gen)
                table.move_to_end(key)
            over = sum(len(g) for g in self._groups.values()) - self.capacity
            while over > 0:
                biggest = max(self._groups.values(), key=len)
                biggest.popitem(last=False)
                over -= 1

    def find(self, group_idx: int, keys: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """``(slots, generations)`` aligned with ``keys``: -1 and 0 where unknown. Recency is
        not updated here (this is on a hit's path): a hit loaded from the view is reported to
        the daemon afterwards and its answer, learned, renews the entries."""
        with self._lock:
            table = self._groups.get(group_idx)
            if table is None:
                return [-1] * len(keys), [0] * len(keys)
            get, unknown = table.get, (-1, 0)
            hits = [get(key, unknown) for key in keys]
        return [h[0] for h in hits], [h[1] for h in hits]

    def clear(self, capacity: int | None = None) -> None:
        """Forget everything (a new registration: the daemon may have restarted); ``capacity``:
        the new bound (the registered layouts' slots: no more entries can be right)."""
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        with self._lock:
            self._groups.clear()
            if capacity is not None:
                self.capacity = capacity


def vouched(table: np.ndarray, slots: Sequence[int], generations: Sequence[int]) -> list[int]:
    """``slots`` with -1 wherever ``table`` (a generation table, one uint64 per slot) does not
    show the expected generation now."""
    s = np.asarray(slots, dtype=np.int64)
    ok = (s >= 0) & (s < len(table))
    ok[ok] = table[s[ok]] == np.asarray(generations, dtype=np.uint64)[ok]
    return np.where(ok, s, -1).tolist()


@dataclass
class SpeculativeLoad:
    """A load started from the view, without asking the daemon."""

    request_id: str
    queries: list[GroupQuery]
    """The Lookup that tells the daemon of the hit afterwards (every group, the same keys)."""
    expected: dict[int, tuple[list[int], list[int]]]
    """Per group, the (slot, generation) the view gave for each key."""
    used: dict[int, set[int]] | None = None
    """Per group, the keys whose slots the load read (set once the load is issued)."""
    done: torch.cuda.Event | None = None
    timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    tokens: int = 0
    """Hit tokens the load counted (taken back if the check fails)."""

    def still_valid(self, tables: dict[int, np.ndarray]) -> bool:
        """After the copies completed: every slot the load read still shows the generation the
        view gave (a group without a table never confirms)."""
        for gi, used in (self.used or {}).items():
            if not used:
                continue
            table = tables.get(gi)
            if table is None:
                return False
            slots, gens = self.expected[gi]
            idx = sorted(used)
            if vouched(table, [slots[i] for i in idx], [gens[i] for i in idx]).count(-1):
                return False
        return True


def leading(slots: Sequence[int]) -> int:
    """How many slots lead before the first unknown (-1)."""
    try:
        return slots.index(-1)
    except ValueError:
        return len(slots)


def vouched_hit(
    view: TierView, tables: Mapping[int, np.ndarray], groups: Sequence[KVCacheGroup],
    keys: Sequence[bytes], first: int, num_gpu_hit: int, k: int, block_size: int,
) -> dict[int, tuple[list[int], list[int]]] | None:
    """Per group, the (slot, generation) of each key from the view, when the generation tables
    vouch for enough of them to load every key (engine.offload.lookup's hit rule); slots they
    do not vouch for are -1. None otherwise, or without a table per group: ask first (the
    daemon may know more than the view)."""
    if len(tables) != len(groups):
        return None
    known: dict[int, tuple[list[int], list[int]]] = {}
    inputs: dict[int, GroupHitInput] = {}
    for g in groups:
        gi = g.spec.group_idx
        slots, gens = view.find(gi, keys)
        slots = vouched(tables[gi], slots, gens)
        known[gi] = (slots, gens)
        inputs[gi] = GroupHitInput(g.spec.sliding_window, leading(slots), tuple(slots))
    if hit_length(inputs, len(keys), first, num_gpu_hit, k, block_size) < len(keys):
        return None
    return known
