"""Which host-tier prefix an admission can load: the keys to look up, the hit rule, and the
copies that load a hit.

Offloaded block ``s`` covers engine blocks ``[s*k, s*k+k)`` and is keyed by the digest of the
last one (the chain covers everything before it). The first one looked up is the one holding
the first block after the GPU hit, so it may start inside the hit.

A hit of ``n`` offloaded blocks needs, in every full-attention group, all of them (a prefix);
in every sliding-window group, only those holding engine blocks still inside the window once
the load is done (the engine leaves the rest null: never allocated, loaded or hashed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from engine.block_pool import NULL_BLOCK_ID
from engine.kv_cache import KVCacheGroup, first_visible_block
from engine.offload.copies import ArenaBlocks
from engine.offload.layer_plan import GroupLoad


@dataclass(frozen=True)
class GroupHitInput:
    sliding_window: int | None
    """Tokens; None for full attention."""
    num_prefix: int
    """Leading offloaded blocks ready in the host tier (what a prefix_only lookup returns)."""
    slots: tuple[int, ...]
    """Slot per key looked up, -1 where not ready (sliding groups look up every key)."""


def lookup_keys(digests: Sequence[bytes], num_gpu_hit: int, k: int) -> tuple[int, tuple[bytes, ...]]:
    """``(first offloaded block, keys)``: the keys of every complete offloaded block from the one
    that holds engine block ``num_gpu_hit`` on."""
    first = num_gpu_hit // k
    return first, tuple(digests[first * k + k - 1 : len(digests) // k * k : k])


def hit_length(
    groups: Mapping[int, GroupHitInput], num_keys: int, first: int, num_gpu_hit: int, k: int,
    block_size: int,
) -> int:
    """How many offloaded blocks (from ``first``) can be loaded for every group at once."""
    full = [g.num_prefix for g in groups.values() if g.sliding_window is None]
    n = min(full) if full else num_keys
    while n > 0:
        end = (first + n) * k  # engine blocks computed once the load is done
        if all(
            all(g.slots[s] >= 0 for s in range(_needed_from(g, end, num_gpu_hit, k, block_size) - first, n))
            for g in groups.values()
            if g.sliding_window is not None
        ):
            return n
        n -= 1
    return 0


def _needed_from(g: GroupHitInput, end: int, num_gpu_hit: int, k: int, block_size: int) -> int:
    """First offloaded block a sliding group must load when ``end`` engine blocks are computed."""
    return max(num_gpu_hit, first_visible_block(end * block_size, g.sliding_window, block_size)) // k


def plan_load(
    groups: Sequence[KVCacheGroup], arenas: Mapping[int, ArenaBlocks], k: int,
    slots: Mapping[int, Sequence[int]], start: int, block_ids: Mapping[int, Sequence[int]], n: int,
) -> tuple[list[GroupLoad], dict[int, set[int]], int]:
    """The copies of a hit of ``n`` engine blocks that starts ``start`` engine blocks into its
    first offloaded block (``slots``: per group, the slot of each offloaded block from that one
    on; ``block_ids``: per group, the GPU blocks, null where the window hides the block).
    Returns per group the GPU blocks and arena slots in engine blocks, per group the offloaded
    blocks read, and the bytes moved. Raises on bad input."""
    # On the host's path to the first copy (a 4096-token hit plans 256 blocks): in numpy, or
    # in plain lists when there is nothing to map.
    positions = np.arange(start, start + n)  # engine blocks from the first offloaded block on
    plan: list[GroupLoad] = []
    used: dict[int, set[int]] = {}
    nbytes = 0
    for g in groups:
        gi = g.spec.group_idx
        given = block_ids[gi][:n]
        if len(given) != n:
            raise RuntimeError(f"group {gi}: {len(given)} block ids for a load of {n} blocks")
        if k == 1 and n and NULL_BLOCK_ID not in given:
            # The common case, without numpy: an offloaded block is an engine block and every
            # block loads, so the plan is the lookup's slots as they are (~5x faster at 500).
            found = list(slots[gi][start : start + n])
            if len(found) != n:
                raise IndexError(f"group {gi}: {len(found)} slots for a load of {n} blocks")
            if min(found) < 0:
                raise RuntimeError(f"group {gi}: asked to load a block the lookup did not find")
            used[gi] = set(range(start, start + n))
            plan.append(GroupLoad(gi, arenas[gi], g.tensor, list(given), found))
            nbytes += n * g.block_bytes
            continue
        ids = np.asarray(given, dtype=np.int64)
        # Null ids: sliding-window blocks already outside the window, left unloaded.
        keep = ids != NULL_BLOCK_ID
        pos = positions if keep.all() else positions[keep]
        offloaded = pos // k
        group_slots = np.asarray(slots[gi], dtype=np.int64)[offloaded]
        if (group_slots < 0).any():
            raise RuntimeError(f"group {gi}: asked to load a block the lookup did not find")
        used[gi] = set(offloaded.tolist())
        plan.append(GroupLoad(gi, arenas[gi], g.tensor, ids[keep].tolist(),
                              (group_slots * k + pos % k).tolist()))
        nbytes += len(pos) * g.block_bytes
    return plan, used, nbytes
