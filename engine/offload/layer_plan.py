"""How one group's share of a layer-by-layer load moves (engine.offload.layerwise): the load
(:class:`GroupLoad`), the layer units a load is copied in (:func:`copy_units`), and the plan of
its copies (:class:`GroupPlan`): blocks sorted by arena slot, runs where slots and GPU block ids
both follow on (one 2-D DMA copy per run and unit on CUDA), else gathers through the mapped arena.
Bad input (slots out of range, blocks and slots of different counts) raises before anything is
copied.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from engine.offload.copies import ArenaBlocks
from engine.offload.cuda_runtime import CUDA_MEMCPY_DEFAULT


@dataclass(frozen=True)
class GroupLoad:
    """One group's share of a load: ``kv[block_ids[i]] = arena slot slots[i]`` (engine blocks)."""

    group_idx: int
    arena: ArenaBlocks
    kv: Tensor  # [num_blocks, layers, ...]
    block_ids: Sequence[int]
    slots: Sequence[int]


def _layer_dtype(layer_bytes: int, fallback: torch.dtype) -> torch.dtype:
    """Move one layer of a block as wide elements where its size allows (fewer accesses)."""
    for dtype, n in ((torch.complex128, 16), (torch.int64, 8)):
        if layer_bytes % n == 0:
            return dtype
    return fallback


def copy_units(num_layers: int, halving: bool = True) -> list[tuple[int, int]]:
    """The layer ranges ``[a, b)`` that a load copies with one call each (CUDA).

    A 4,096-token CPU hit on an H200 (256 blocks, 8 MiB a layer) took ~0.5 ms less with these
    units than with 16 per-layer copies in the same run, though the same copies issued back to
    back with no step beside them moved at the same rate either way (DECISIONS 71): fewer,
    larger copies while the step runs. The step waits for the unit of the layer it reaches and
    only the compute of the last unit comes after the last copy, so the units halve toward the
    end and the last is one layer. ``halving`` False: one unit per layer."""
    if not halving:
        return [(li, li + 1) for li in range(num_layers)]
    units, a = [], 0
    while num_layers - a > 1:
        b = a + (num_layers - a) // 2
        units.append((a, b))
        a = b
    units.append((a, num_layers))
    return units


class GroupPlan:
    """How one group's blocks move, layer by layer."""

    def __init__(self, load: GroupLoad, memcpy_2d: object | None, halving: bool = True) -> None:
        self.load = load
        kv, arena = load.kv, load.arena
        self.layers = int(kv.shape[1])
        self.units = copy_units(self.layers, halving)
        self.block_bytes = kv[0].numel() * kv.element_size()
        if self.block_bytes % self.layers:
            raise ValueError(f"a block of {self.block_bytes} bytes does not split into {self.layers} layers")
        self.layer_bytes = self.block_bytes // self.layers
        self.dtype = _layer_dtype(self.layer_bytes, kv.dtype)
        if len(load.block_ids) != len(load.slots):
            raise ValueError(f"{len(load.block_ids)} blocks but {len(load.slots)} slots")
        # In numpy: a 4096-token hit plans 256 blocks, on the host's path to its first copy.
        spc = arena.geometry.slots_per_chunk
        slots = np.asarray(load.slots, dtype=np.int64)
        ids = np.asarray(load.block_ids, dtype=np.int64)
        order = np.lexsort((ids, slots))  # by slot, then block id
        slots, ids = slots[order], ids[order]
        for s in (int(slots[0]), int(slots[-1])):
            if not 0 <= s < arena.geometry.max_slots:
                raise IndexError(f"slot {s} outside [0, {arena.geometry.max_slots})")
        chunk, local = np.divmod(slots, spc)
        # Per chunk file: (slots inside the chunk, block ids), in slot order.
        bounds = np.flatnonzero(chunk[1:] != chunk[:-1]) + 1
        self.chunks: dict[int, tuple[list[int], list[int]]] = {
            int(chunk[a]): (local[a:b].tolist(), ids[a:b].tolist())
            for a, b in zip([0, *bounds.tolist()], [*bounds.tolist(), len(slots)], strict=True)
        }
        # Runs where the slot (inside one chunk) and the block id both go up by one:
        # [chunk, first local slot, first block id, length].
        brk = np.ones(len(slots), dtype=bool)
        brk[1:] = (np.diff(slots) != 1) | (np.diff(ids) != 1) | (chunk[1:] != chunk[:-1])
        starts = np.flatnonzero(brk)
        lengths = np.diff(starts, append=len(slots))
        runs = list(zip(chunk[starts].tolist(), local[starts].tolist(), ids[starts].tolist(),
                        lengths.tolist(), strict=True))
        cuda = kv.is_cuda
        pageable = cuda and any(arena.chunk_is_pageable(c) for c in self.chunks)
        self.dma = bool(cuda and memcpy_2d is not None and not pageable and len(runs) * 4 <= len(slots))
        self.pageable = pageable
        self.dma_runs = [(arena.host_chunk(c).data_ptr() + s * self.block_bytes,
                          kv.data_ptr() + b * self.block_bytes, n) for c, s, b, n in runs] if self.dma else []
        # Gather path: per chunk, the source as [slots, layers, elements] (the device alias on
        # CUDA) and the two index tensors, made once for every layer. On CUDA the indices are
        # uploaded on the current stream, which the load stream waits for (LayerLoads.add).
        self._gathers: list[tuple[Tensor, Tensor, Tensor]] = []
        self._dst: Tensor | None = None
        if not self.dma:
            self._prepare_gathers()

    def _prepare_gathers(self) -> None:
        kv, arena = self.load.kv, self.load.arena
        dev = kv.device
        self._dst = kv.view(kv.shape[0], -1).view(torch.uint8).view(kv.shape[0], self.layers, -1).view(self.dtype)
        for c, (local, ids) in self.chunks.items():
            view = arena.device_chunk(c) if kv.is_cuda and not self.pageable else arena.host_chunk(c)
            src = view.view(torch.uint8).view(view.shape[0], self.layers, -1).view(self.dtype)
            local_t = arena.index(local, torch.device("cpu") if self.pageable else dev)
            self._gathers.append((src, local_t, arena.index(ids, dev)))

    def copy_layers(self, a: int, b: int, memcpy_2d: Callable[..., int] | None = None,
                    handle: ctypes.c_void_p | None = None) -> None:
        """Enqueue (CUDA: on ``handle``'s stream for DMA, else on the current stream) or do
        (CPU) the copy of layers ``[a, b)`` of every block."""
        if self.dma:
            assert memcpy_2d is not None
            off, bb, width = a * self.layer_bytes, self.block_bytes, (b - a) * self.layer_bytes
            for src_ptr, dst_ptr, n in self.dma_runs:
                err = memcpy_2d(dst_ptr + off, bb, src_ptr + off, bb, width, n, CUDA_MEMCPY_DEFAULT, handle)
                if err != 0:
                    raise RuntimeError(f"cudaMemcpy2DAsync of layers {a}-{b - 1} failed: error {err}")
            return
        assert self._dst is not None
        dst = self._dst[:, a:b]
        for src, local, ids in self._gathers:
            rows = src[:, a:b].index_select(0, local)
            dst.index_copy_(0, ids, rows.to(dst.device) if self.pageable else rows)
