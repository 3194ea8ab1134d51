"""The events of one record applied to one source's tiers: CacheState's hot loop.

Every consumer of the log (the daemon's recovery, the bridge, subscribers, kvctl) spends its
time here, so the common cases, a valid BlockStored or BlockRemoved, run inline with locals and
no per-block allocation (events.state_tier). Their checks accept exactly what
``validate_event`` accepts for the types the schema declares; anything else, an invalid event
included, takes the general path, which validates with ``validate_event`` for the message.
A ``BlockStored`` may come packed (events.packed): its token ids are counted from their
header, and the tier keeps the packed event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from events.packed import PackedStored, count_ids, unpacked
from events.schema import (
    MAX_HASH,
    MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    SchemaError,
    validate_event,
)
from events.state_changes import TierEdits, TierKey
from events.state_tier import Tier

Violate = Callable[[int, str, str, str], None]  # (offset, source, kind, detail)


def apply_events(
    tiers: dict[TierKey, Tier],
    events: Iterable[Event],
    offset: int,
    source: str,
    violate: Violate,
    edits: TierEdits,
) -> None:
    """Apply ``events`` to one source's ``tiers``. ``edits`` counts, per tier, the changes that
    are not blocks appended at its end (a removal, a hash stored again, the tier cleared): one
    bump per event, never per block (CacheState.edits); while changes are tracked it also
    records which hashes they were (CacheState.take_changes)."""
    for event in events:
        if type(event) is BlockStored or type(event) is PackedStored:
            hashes = event.block_hashes
            n = len(hashes)
            bs = event.block_size
            parent = event.parent_block_hash
            keys = event.extra_keys
            medium = event.medium
            group = event.group_idx
            ids: Any = event.token_ids
            ok = (
                n > 0
                and bs > 0
                and (count_ids(ids) if type(ids) is msgspec.Raw else len(ids)) == n * bs
                and medium in MEDIA
                and group >= 0
                and (parent is None or 0 <= parent <= MAX_HASH)
                and (keys is None or len(keys) == n)
            )
            if ok:
                for h in hashes:
                    if not 0 <= h <= MAX_HASH:
                        ok = False
                        break
            if ok:
                key = (medium, group)
                tier = tiers.get(key)
                if tier is None:
                    tier = tiers[key] = {}
                if parent is not None and medium == "GPU" and parent not in tier:
                    _orphan(violate, offset, source, event)
                if n == 1:  # vLLM's common event: one check, no loop
                    h = hashes[0]
                    if h in tier:  # stored again: changed in place
                        edits.rewrote(key, hashes)
                    tier[h] = event
                    continue
                before = len(tier)
                for h in hashes:
                    tier[h] = event
                if len(tier) - before != n:  # a hash stored again: changed in place
                    edits.rewrote(key, hashes)
                continue
        elif type(event) is BlockRemoved:
            hashes = event.block_hashes
            medium = event.medium
            group = event.group_idx
            ok = medium in MEDIA and group >= 0
            if ok:
                for h in hashes:
                    if not 0 <= h <= MAX_HASH:
                        ok = False
                        break
            if ok:
                _remove(tiers, event, offset, source, violate, edits)
                continue
        _apply_checked(tiers, event, offset, source, violate, edits)


def _apply_checked(
    tiers: dict[TierKey, Tier],
    event: Event,
    offset: int,
    source: str,
    violate: Violate,
    edits: TierEdits,
) -> None:
    """The general path: any event type (subclasses included), validated first; a packed
    event is checked as the BlockStored it stands for (and stored as one)."""
    try:
        if type(event) is PackedStored:
            event = unpacked(event)
        if not isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared):
            raise SchemaError(f"not an event: {type(event).__name__}")
        validate_event(event)
    except SchemaError as exc:
        violate(offset, source, "invalid_event", str(exc))
        return
    if isinstance(event, BlockStored):
        key = (event.medium, event.group_idx)
        tier = tiers.setdefault(key, {})
        parent = event.parent_block_hash
        if event.medium == "GPU" and parent is not None and parent not in tier:
            _orphan(violate, offset, source, event)
        before = len(tier)
        for h in event.block_hashes:
            tier[h] = event
        if len(tier) - before != len(event.block_hashes):
            edits.rewrote(key, event.block_hashes)
    elif isinstance(event, BlockRemoved):
        _remove(tiers, event, offset, source, violate, edits)
    else:
        for key in [k for k in tiers if event.medium is None or k[0] == event.medium]:
            del tiers[key]
            edits.reset(key)


def _orphan(violate: Violate, offset: int, source: str, event: BlockStored) -> None:
    # The CPU tier evicts parents before children legitimately; the GPU tier not.
    violate(
        offset,
        source,
        "orphan_child",
        f"parent {event.parent_block_hash} of {event.block_hashes[0]} not resident in "
        f"GPU group {event.group_idx}",
    )


def _remove(
    tiers: dict[TierKey, Tier],
    event: BlockRemoved,
    offset: int,
    source: str,
    violate: Violate,
    edits: TierEdits,
) -> None:
    key = (event.medium, event.group_idx)
    tier = tiers.get(key)
    if tier is None:
        tier = {}
    elif tier:
        edits[key] = edits.get(key, 0) + 1  # a hole (or none: counted anyway, once per event)
        changes = edits.changes
        if changes is not None:  # inline: a GPU tier evicts in every batch
            journal = changes.get(key) or edits.journal(key)
            journal.removed.extend(event.block_hashes)
    for h in event.block_hashes:
        if tier.pop(h, None) is None:  # stored values are events, never None
            violate(
                offset,
                source,
                "unknown_block_removed",
                f"{h} not resident in {event.medium} group {event.group_idx}",
            )
