"""Eviction order over evictable blocks (ready and unpinned): LRU, or ARC as an option.

A policy only orders keys; the index decides what is evictable and adds/removes keys as blocks
become ready, get pinned, are unpinned or leave.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class EvictionPolicy(Protocol):
    def add(self, key: bytes) -> None:
        """A block became evictable (committed, or unpinned)."""

    def add_many(self, keys: list[bytes]) -> None:
        """Recovery: many new evictable blocks at once (their old order is not known)."""

    def remove(self, key: bytes) -> None:
        """A block stopped being evictable (pinned, evicted, dropped); no-op if absent."""

    def evicted(self, key: bytes) -> None:
        """The block left the tier (evicted or dropped)."""

    def touch(self, key: bytes) -> None:
        """A block was hit by a Lookup."""

    def victims(self, n: int) -> list[bytes]:
        """Up to ``n`` keys in eviction order, without removing them."""

    def __len__(self) -> int: ...


class LruPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)
        else:
            self._order[key] = None

    def add_many(self, keys: list[bytes]) -> None:
        if self._order:
            self._order.update(dict.fromkeys(keys))
        else:  # recovery's case: 4x faster than update for 100k keys
            self._order = OrderedDict.fromkeys(keys)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def evicted(self, key: bytes) -> None:
        self._order.pop(key, None)

    def touch(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def victims(self, n: int) -> list[bytes]:
        out: list[bytes] = []
        for key in self._order:
            if len(out) >= n:
                break
            out.append(key)
        return out

    def __len__(self) -> int:
        return len(self._order)


class ArcPolicy:
    """Adaptive replacement (Megiddo & Modha) over the evictable set.

    T1 holds blocks seen once, T2 blocks hit again; ghosts B1/B2 remember recent victims of each
    and move the target size ``p`` of T1. Blocks that are re-stored after eviction from T1/T2 are
    recognised by their ghost entry. Ghost lists are capped at ``ghost_cap`` keys.
    """

    def __init__(self, ghost_cap: int = 65_536) -> None:
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._hot: set[bytes] = set()  # keys that were hit while pinned (belong in T2)
        self._p = 0.0
        self._ghost_cap = ghost_cap

    def add(self, key: bytes) -> None:
        if key in self._b1:
            self._p = min(self._p + max(1.0, len(self._b2) / max(1, len(self._b1))), 1e18)
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(self._p - max(1.0, len(self._b1) / max(1, len(self._b2))), 0.0)
            del self._b2[key]
            self._t2[key] = None
        elif key in self._hot:
            self._hot.discard(key)
            self._t2[key] = None
        else:
            self._t1[key] = None

    def add_many(self, keys: list[bytes]) -> None:
        if self._t1:
            self._t1.update(dict.fromkeys(keys))
        else:
            self._t1 = OrderedDict.fromkeys(keys)

    def remove(self, key: bytes) -> None:
        # Removal for pinning keeps the block's history; eviction goes through _ghost().
        if self._t1.pop(key, 1) is None:
            return
        if self._t2.pop(key, 1) is None:
            self._hot.add(key)

    def evicted(self, key: bytes) -> None:
        """The block left the tier: remember it in the ghost list of where it was."""
        if self._t1.pop(key, 1) is None:
            self._ghost(self._b1, key)
        elif self._t2.pop(key, 1) is None or key in self._hot:
            self._hot.discard(key)
            self._ghost(self._b2, key)

    def _ghost(self, ghosts: OrderedDict[bytes, None], key: bytes) -> None:
        ghosts[key] = None
        while len(ghosts) > self._ghost_cap:
            ghosts.popitem(last=False)

    def touch(self, key: bytes) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)
        else:
            self._hot.add(key)  # hit while pinned: promote when it becomes evictable

    def victims(self, n: int) -> list[bytes]:
        # Take from T1 while it is above its target size p, then from T2, then whatever is left.
        out: list[bytes] = []
        t1_excess = max(0, len(self._t1) - int(self._p))
        for key in self._t1:
            if len(out) >= min(n, t1_excess):
                break
            out.append(key)
        taken = set(out)
        for source in (self._t2, self._t1):
            for key in source:
                if len(out) >= n:
                    return out
                if key not in taken:
                    out.append(key)
        return out

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


def make_policy(name: str) -> LruPolicy | ArcPolicy:
    if name == "lru":
        return LruPolicy()
    if name == "arc":
        return ArcPolicy()
    raise ValueError(f"unknown eviction policy {name!r}")
