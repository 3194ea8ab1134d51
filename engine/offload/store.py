"""Turns each step's newly full engine blocks into store jobs of offloaded blocks.

An offloaded block is ``multiple`` consecutive engine blocks of one request (block_size option,
as vLLM's offloading connector has): its hash is the digest of its last engine block (the chain
covers everything before), its parent the digest of the engine block before it, its tokens those
of all its engine blocks. Engine blocks are snapshotted with one gather per group per step as
they become full; those of an offloaded block that is not complete yet (decode fills blocks one
step at a time) wait here as rows of their step's snapshot until the rest arrives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.kv_cache import KVCacheGroup
from engine.kv_connector import NewBlocks
from engine.offload.copies import ArenaBlocks
from offloadd.client import BlockToStore


@dataclass(frozen=True)
class _Staged:
    snapshot: Tensor
    row: int
    digest: bytes
    parent: bytes | None
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class StoreBatch:
    """Rows of ``staging`` (``multiple`` engine blocks per offloaded block, in order) and the
    offloaded blocks they form."""

    staging: Tensor
    blocks: list[BlockToStore]


class StoreBatcher:
    def __init__(self, multiple: int) -> None:
        self.multiple = multiple
        self._partial: dict[tuple[str, int], dict[int, _Staged]] = {}

    def batch(
        self, group: KVCacheGroup, arena: ArenaBlocks, new: list[NewBlocks], skip: set[bytes]
    ) -> StoreBatch | None:
        """Snapshot the new blocks (one gather) and return the offloaded blocks now complete."""
        for nb in new:
            if not len(nb.token_ids) == len(nb.parents) == len(nb.block_ids):
                raise ValueError("NewBlocks lacks token_ids/parents; the engine must fill them in")
        entries = [
            (nb.request_id, idx, b, d, p, t)
            for nb in new
            for b, d, p, t, idx in zip(nb.block_ids, nb.digests, nb.parents, nb.token_ids,
                                       nb.block_indices, strict=True)
            if d not in skip
        ]
        if not entries:
            return None
        snapshot = arena.gather(group.tensor, [e[2] for e in entries])
        if self.multiple == 1:
            return StoreBatch(snapshot, [BlockToStore(e[3], e[4], e[5]) for e in entries])
        touched: set[tuple[str, int]] = set()
        for row, (rid, idx, _b, d, p, t) in enumerate(entries):
            key = (rid, group.spec.group_idx)
            self._partial.setdefault(key, {})[idx] = _Staged(snapshot, row, d, p, t)
            touched.add(key)
        rows: list[_Staged] = []
        blocks: list[BlockToStore] = []
        for key in sorted(touched):
            self._take_complete(self._partial[key], rows, blocks)
        if not blocks:
            return None
        return StoreBatch(_stack(rows, snapshot), blocks)

    def _take_complete(
        self, staged: dict[int, _Staged], rows: list[_Staged], blocks: list[BlockToStore]
    ) -> None:
        k = self.multiple
        for first in sorted({idx - idx % k for idx in staged}):
            run = [staged.get(first + j) for j in range(k)]
            if any(s is None for s in run):
                continue
            parts = [s for s in run if s is not None]
            rows.extend(parts)
            blocks.append(BlockToStore(
                parts[-1].digest, parts[0].parent, tuple(t for s in parts for t in s.tokens)
            ))
            for j in range(k):
                del staged[first + j]

    def drop(self, request_id: str) -> None:
        """The request left: its incomplete offloaded blocks will never complete."""
        for key in [key for key in self._partial if key[0] == request_id]:
            del self._partial[key]


def _stack(rows: list[_Staged], current: Tensor) -> Tensor:
    """One tensor of the given rows, in order (one gather when all are from this step)."""
    if all(s.snapshot is current for s in rows):
        idx = [s.row for s in rows]
        if idx == list(range(len(current))):
            return current
        return current.index_select(0, torch.tensor(idx, device=current.device))
    return torch.cat([s.snapshot[s.row : s.row + 1] for s in rows])
