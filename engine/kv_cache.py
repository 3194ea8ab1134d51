"""KV-cache groups and their memory: one block-major tensor per group.

Layout per group: ``[num_blocks + 1, num_layers_in_group, 2, block_size, num_kv_heads, head_dim]``
(block 0 is the null block). One block is contiguous across the group's layers, K and V, so a
single copy of ``block_bytes`` moves it; this is what the offload connector copies into a host
arena slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch
from torch import Tensor

from engine.model.config import ModelConfig
from events.schema import SpecKind

KV_LAYOUT: Final[str] = "block,layer,kv,token,head,dim"


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share block tables: group 0 full attention, group 1 sliding window."""

    group_idx: int
    kind: SpecKind
    sliding_window: int | None
    layer_ids: tuple[int, ...]


def first_visible_block(num_tokens: int, sliding_window: int | None, block_size: int) -> int:
    """The sliding window's rule: blocks before this index are invisible to every query at
    positions >= ``num_tokens`` (a query at p sees keys (p - window, p]); 0 for full attention.
    The KV manager frees (and a load skips) the blocks before it; the step's attention starts
    its keys there."""
    if sliding_window is None:
        return 0
    return max(0, num_tokens - sliding_window + 1) // block_size


@dataclass(frozen=True)
class KVCacheGroup:
    """A group's spec and its KV tensor, as the model runner and the offload connector see it."""

    spec: KVCacheGroupSpec
    tensor: Tensor
    block_size: int

    @property
    def block_bytes(self) -> int:
        t = self.tensor
        return int(t[0].numel() * t.element_size())

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def layout(self) -> str:
        return KV_LAYOUT

    @property
    def num_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return int(self.tensor.shape[0]) - 1


def kv_group_specs(cfg: ModelConfig) -> list[KVCacheGroupSpec]:
    """Full-attention layers first (group 0), sliding-window layers second."""
    specs: list[KVCacheGroupSpec] = []
    full = tuple(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
    sliding = tuple(i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention")
    if full:
        specs.append(KVCacheGroupSpec(len(specs), "full_attention", None, full))
    if sliding:
        specs.append(KVCacheGroupSpec(len(specs), "sliding_window", cfg.sliding_window, sliding))
    return specs


def allocate_kv_cache(
    specs: list[KVCacheGroupSpec],
    cfg: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[KVCacheGroup]:
    # Zero-filled so that masked-out reads of the null block can never produce NaN.
    return [
        KVCacheGroup(
            spec=s,
            tensor=torch.zeros(
                (num_blocks + 1, len(s.layer_ids), 2, block_size, cfg.num_kv_heads, cfg.head_dim),
                dtype=dtype,
                device=device,
            ),
            block_size=block_size,
        )
        for s in specs
    ]


def layer_slots(specs: list[KVCacheGroupSpec]) -> dict[int, tuple[int, int]]:
    """layer id -> (group_idx, index of the layer inside its group's tensor)."""
    return {layer: (s.group_idx, i) for s in specs for i, layer in enumerate(s.layer_ids)}
