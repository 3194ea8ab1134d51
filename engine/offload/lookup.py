"""Which host-tier prefix an admission can load: the keys to look up and the hit rule.

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


def first_needed_block(num_tokens: int, sliding_window: int | None, block_size: int) -> int:
    """Engine blocks before this index are invisible to every query at positions >= num_tokens
    (the engine's KVCacheManager rule)."""
    if sliding_window is None:
        return 0
    return max(0, num_tokens - sliding_window + 1) // block_size


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
    return max(num_gpu_hit, first_needed_block(end * block_size, g.sliding_window, block_size)) // k
