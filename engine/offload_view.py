"""What this engine knows of the host tier: where its blocks sit, to load them before asking.

A CPU-tier hit used to wait for the pinning Lookup (a gRPC round trip, ~1-1.8 ms on an H200
host) before its first copy. The engine already knows where most of its hits sit: it stored
them itself (each Reserve answers a slot and that assignment's *generation*) and earlier
lookups answered more. With this view the connector starts the copies at once, from the slots
it remembers, sends the pinning Lookup at the same time, and checks the Lookup's answer before
the step's result is used (engine.connector ``check_loads``):

- the same slot and generation for every block loaded: no slot was given to another block
  between the engine learning it and the pin (a generation names one assignment of a slot,
  unique across daemon restarts), so every byte read before the pin was the block's own, and
  the pin protects the rest;
- anything else: the step's result for that request is dropped and it is admitted again,
  asking first this time. The view then holds the daemon's answer.

The daemon never tells the engine about evictions, so entries go stale; a stale entry costs one
wasted step of one request, once. Bounded by the daemon's slots (no more entries can be right):
least recently used entries go first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from offloadd.client import GroupQuery, LookupFuture, LookupOutcome


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
        """``(slots, generations)`` aligned with ``keys``: -1 and 0 where unknown."""
        with self._lock:
            table = self._groups.get(group_idx)
            if table is None:
                return [-1] * len(keys), [0] * len(keys)
            slots, gens = [], []
            for key in keys:
                hit = table.get(key)
                if hit is None:
                    slots.append(-1)
                    gens.append(0)
                else:
                    table.move_to_end(key)
                    slots.append(hit[0])
                    gens.append(hit[1])
            return slots, gens

    def clear(self, capacity: int | None = None) -> None:
        """Forget everything (a new registration: the daemon may have restarted); ``capacity``:
        the new bound (the registered layouts' slots: no more entries can be right)."""
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        with self._lock:
            self._groups.clear()
            if capacity is not None:
                self.capacity = capacity


@dataclass
class SpeculativeLoad:
    """A load started from the view before the daemon answered its pinning Lookup."""

    request_id: str
    queries: list[GroupQuery]
    """The pinning Lookup's queries (every group looks up the same keys)."""
    expected: dict[int, tuple[list[int], list[int]]]
    """Per group, the (slot, generation) the view gave for each key."""
    used: dict[int, set[int]] | None = None
    """Per group, the keys whose slots the load read (set once the load is issued)."""
    done: torch.cuda.Event | None = None
    timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    tokens: int = 0
    """Hit tokens the load counted (taken back if the answer disagrees)."""
    future: LookupFuture | None = None
    """The pinning Lookup, sent at admission without waiting for its answer."""

    @property
    def keys(self) -> tuple[bytes, ...]:
        return self.queries[0].block_hashes

    def confirmed_by(self, answer: LookupOutcome) -> bool:
        """Every slot the load read has, in the answer, the slot and generation the view gave."""
        results = {r.group_idx: r for r in answer.results}
        for gi, used in (self.used or {}).items():
            slots, gens = self.expected[gi]
            r = results.get(gi)
            got_slots = r.slots if r is not None else ()
            got_gens = r.generations if r is not None else ()
            if any(i >= len(got_slots) or i >= len(got_gens) or got_slots[i] != slots[i]
                   or got_gens[i] != gens[i] for i in used):
                return False
        return True


def leading(slots: Sequence[int]) -> int:
    """How many slots lead before the first unknown (-1)."""
    for i, slot in enumerate(slots):
        if slot < 0:
            return i
    return len(slots)
