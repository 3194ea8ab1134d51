"""Export of one tier of CacheState as BlockStored events, each parent before its children.

Blocks that chain (each the parent of the next) and share block size, spec and LoRA travel as
one event, which keeps snapshots small: a prompt's blocks come back as one event. It reads the
tier as stored (events.state_tier), without building a BlockEntry per block.
"""

from __future__ import annotations

from events.packed import token_ids
from events.schema import BlockStored, Medium
from events.state_tier import Tier, positions


def export_tier(tier: Tier, medium: Medium, group: int) -> list[BlockStored]:
    """Chains of compatible blocks as one event each; roots first, then depth-first."""
    # Plain ints in two dicts, not a tuple per block: allocations would wake the collector.
    parents: dict[int, int | None] = {}
    at: dict[int, int] = {}  # position of the block in tier[h]
    children: dict[int, list[int]] = {}
    roots: list[int] = []
    # id(event) -> its positions; the tier keeps every event alive meanwhile, so ids are stable.
    index: dict[int, dict[int, int]] = {}
    for h, ev in tier.items():
        hashes = ev.block_hashes
        if len(hashes) == 1:
            i, p = 0, ev.parent_block_hash
        else:
            where = index.get(id(ev))
            if where is None:
                where = index[id(ev)] = positions(hashes)
            i = where[h]
            p = ev.parent_block_hash if i == 0 else hashes[i - 1]
        parents[h] = p
        at[h] = i
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
                below = children.get(cur)
                if below is None:
                    break
                kids = [k for k in below if k not in emitted]
                if not kids:
                    break
                pending.extend(reversed(kids[1:]))
                nxt = kids[0]
                if not same_kind(tier[nxt], head):
                    pending.append(nxt)
                    break
                chain.append(nxt)
                emitted.add(nxt)
                cur = nxt
            events.append(chain_event(tier, parents[start], at, chain, medium, group))
        if len(emitted) == len(tier):
            return events
        pending.append(next(h for h in leftovers if h not in emitted))


def same_kind(a: BlockStored, b: BlockStored) -> bool:
    return a is b or (
        a.block_size == b.block_size
        and a.kv_cache_spec_kind == b.kv_cache_spec_kind
        and a.sliding_window == b.sliding_window
        and a.lora_name == b.lora_name
    )


def chain_event(
    tier: Tier,
    head_parent: int | None,
    at: dict[int, int],
    chain: list[int],
    medium: Medium,
    group: int,
) -> BlockStored:
    head = tier[chain[0]]
    bs = head.block_size  # shared by the whole chain (_same_kind)
    tokens: list[int] = []
    keys: list[object] = []
    # Consecutive blocks of one stored event are copied as one slice of its token ids.
    run_ev, run_start, run_end = head, 0, 0
    for h in chain:
        ev, i = tier[h], at[h]
        if ev is run_ev and i == run_end:
            run_end += 1
        else:
            tokens.extend(token_ids(run_ev)[run_start * bs : run_end * bs])
            run_ev, run_start, run_end = ev, i, i + 1
        keys.append(None if ev.extra_keys is None else ev.extra_keys[i])
    tokens.extend(token_ids(run_ev)[run_start * bs : run_end * bs])
    return BlockStored(
        block_hashes=tuple(chain),
        parent_block_hash=head_parent,
        token_ids=tuple(tokens),
        block_size=bs,
        medium=medium,
        group_idx=group,
        kv_cache_spec_kind=head.kv_cache_spec_kind,
        sliding_window=head.sliding_window,
        lora_name=head.lora_name,
        extra_keys=None if all(k is None for k in keys) else tuple(keys),
    )
