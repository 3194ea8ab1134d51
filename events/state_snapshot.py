"""CacheState as plain data and back (events.state): :class:`Snapshot`, every source's fence and
resident blocks as BlockStored events, parents first (what checkpoints, bootstraps and
``kvctl`` carry), made from a state's tiers (:func:`snapshot_of`) and read back into tiers
(:func:`tiers_of`, which validates every event: SchemaError on an invalid one).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from events.schema import BlockStored, validate_event
from events.state_chains import export_tier
from events.state_changes import TierKey
from events.state_tier import Tier, store


class SourceSnapshot(msgspec.Struct, frozen=True):
    """One source's fence (incarnation 0 = unfenced) and resident blocks, parents first."""

    source: str
    incarnation: int
    last_seq: int
    events: tuple[BlockStored, ...]


class Snapshot(msgspec.Struct, frozen=True):
    offset: int
    sources: tuple[SourceSnapshot, ...]


def snapshot_of(offset: int, sources: Iterable[str], tiers: Mapping[str, Mapping[TierKey, Tier]],
                fences: Mapping[str, tuple[int, int]]) -> Snapshot:
    """The snapshot of ``sources`` (in that order) with these tiers and fences, at ``offset``:
    each tier as BlockStored events, each parent before any child that references it."""
    out: list[SourceSnapshot] = []
    for source in sources:
        events: list[BlockStored] = []
        for (medium, group), tier in tiers.get(source, {}).items():
            events.extend(export_tier(tier, medium, group))
        inc, seq = fences.get(source, (0, 0))
        out.append(SourceSnapshot(source, inc, seq, tuple(events)))
    return Snapshot(offset, tuple(out))


def tiers_of(snap: Snapshot) -> tuple[dict[str, dict[TierKey, Tier]], dict[str, tuple[int, int]]]:
    """The tiers per source and the fences (fenced sources only) that ``snap`` holds.
    SchemaError on an invalid event."""
    tiers_by_source: dict[str, dict[TierKey, Tier]] = {}
    fences: dict[str, tuple[int, int]] = {}
    for src in snap.sources:
        tiers = tiers_by_source.setdefault(src.source, {})
        if src.incarnation != 0:
            fences[src.source] = (src.incarnation, src.last_seq)
        for event in src.events:
            validate_event(event)
            store(tiers.setdefault((event.medium, event.group_idx), {}), event)
    return tiers_by_source, fences
