"""Export of one tier of CacheState as BlockStored events, each parent before its children.

Blocks that chain (each the parent of the next) and share block size, spec and LoRA travel as
one event, which keeps snapshots small: a prompt's blocks come back as one event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from events.schema import BlockStored, Medium

if TYPE_CHECKING:  # state imports this module; the types are only needed by the checker
    from events.state import BlockEntry

Tier = dict[int, "BlockEntry"]


def export_tier(tier: Tier, medium: Medium, group: int) -> list[BlockStored]:
    """Chains of compatible blocks as one event each; roots first, then depth-first."""
    children: dict[int, list[int]] = {}
    roots: list[int] = []
    for h, entry in tier.items():
        p = entry.parent
        if p is not None and p != h and p in tier:
            children.setdefault(p, []).append(h)
        else:
            roots.append(h)
    emitted: set[int] = set()
    events: list[BlockStored] = []
    pending = list(reversed(roots))
    leftovers = iter(tier)  # blocks on a parent cycle (corrupt input) are reached last
    while True:
        while pending:
            start = pending.pop()
            if start in emitted:
                continue
            chain = [start]
            emitted.add(start)
            head = tier[start]
            cur = start
            while True:
                kids = [k for k in children.get(cur, ()) if k not in emitted]
                if not kids:
                    break
                pending.extend(reversed(kids[1:]))
                nxt = kids[0]
                if not _same_kind(tier[nxt], head):
                    pending.append(nxt)
                    break
                chain.append(nxt)
                emitted.add(nxt)
                cur = nxt
            events.append(_chain_event(tier, chain, medium, group))
        if len(emitted) == len(tier):
            return events
        pending.append(next(h for h in leftovers if h not in emitted))


def _same_kind(a: BlockEntry, b: BlockEntry) -> bool:
    return (
        a.block_size == b.block_size
        and a.kv_cache_spec_kind == b.kv_cache_spec_kind
        and a.sliding_window == b.sliding_window
        and a.lora_name == b.lora_name
    )


def _chain_event(tier: Tier, chain: list[int], medium: Medium, group: int) -> BlockStored:
    entries = [tier[h] for h in chain]
    head = entries[0]
    keys = tuple(e.extra_keys for e in entries)
    token_ids = tuple(t for e in entries for t in e.token_ids)
    return BlockStored(
        block_hashes=tuple(chain),
        parent_block_hash=head.parent,
        token_ids=token_ids,
        block_size=head.block_size,
        medium=medium,
        group_idx=group,
        kv_cache_spec_kind=head.kv_cache_spec_kind,
        sliding_window=head.sliding_window,
        lora_name=head.lora_name,
        extra_keys=None if all(k is None for k in keys) else keys,
    )
