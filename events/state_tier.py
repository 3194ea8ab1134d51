"""How CacheState keeps one tier: each resident block hash maps to the BlockStored that stored it.

Applying is the hot path of the daemon's recovery, the bridge and every subscriber, while the
per-block detail (parent, tokens, spec) is read only by snapshots and a few queries. So storing
an event costs one dict assignment per block and no allocation; :class:`BlockEntry` is built on
demand from the event and the block's position in it. The price is that an event stays alive
while any of its blocks is resident (its token tuple is shared, not sliced per block).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import msgspec

from events.packed import token_ids
from events.schema import BlockStored, SpecKind

Tier = dict[int, BlockStored]  # block hash -> the event that stored it last


class BlockEntry(msgspec.Struct, frozen=True):
    """What the reducer keeps per resident block: enough to re-emit its BlockStored."""

    parent: int | None
    token_ids: tuple[int, ...]
    block_size: int
    kv_cache_spec_kind: SpecKind = "full_attention"
    sliding_window: int | None = None
    lora_name: str | None = None
    extra_keys: Any = None


def store(tier: Tier, event: BlockStored) -> None:
    """Make the event's blocks resident; a hash listed twice keeps its last position."""
    for h in event.block_hashes:
        tier[h] = event


def entry_at(event: BlockStored, i: int) -> BlockEntry:
    """The entry of the block at position ``i`` of ``event`` (packed or not: events.packed;
    SchemaError when a packed event's ids cannot be read)."""
    bs = event.block_size
    start = i * bs
    keys = event.extra_keys
    return BlockEntry(
        event.parent_block_hash if i == 0 else event.block_hashes[i - 1],
        token_ids(event)[start : start + bs],
        bs,
        event.kv_cache_spec_kind,
        event.sliding_window,
        event.lora_name,
        None if keys is None else keys[i],
    )


def positions(hashes: tuple[int, ...]) -> dict[int, int]:
    """Hash -> position in ``hashes``; the last one for a hash listed twice (it won)."""
    return dict(zip(hashes, range(len(hashes)), strict=True))


class _Positions:
    """Position of a hash in the event that stored it, with one index per multi-block event.

    The cache keeps the events it indexed alive, so an ``id`` is never reused within it.
    """

    def __init__(self) -> None:
        self._index: dict[int, tuple[BlockStored, dict[int, int]]] = {}

    def of(self, h: int, event: BlockStored) -> int:
        hashes = event.block_hashes
        if len(hashes) == 1:
            return 0
        cached = self._index.get(id(event))
        if cached is None or cached[0] is not event:
            cached = self._index[id(event)] = (event, positions(hashes))
        return cached[1][h]


class TierView(Mapping[int, BlockEntry]):
    """Read-only live view of a tier as ``hash -> BlockEntry`` (entries built when read)."""

    __slots__ = ("_pos", "_tier")

    def __init__(self, tier: Tier) -> None:
        self._tier = tier
        self._pos = _Positions()

    def __getitem__(self, h: int) -> BlockEntry:
        event = self._tier[h]
        return entry_at(event, self._pos.of(h, event))

    def __contains__(self, h: object) -> bool:
        return h in self._tier

    def __iter__(self) -> Iterator[int]:
        return iter(self._tier)

    def __len__(self) -> int:
        return len(self._tier)

    def __repr__(self) -> str:
        return f"TierView({dict(self)!r})"
