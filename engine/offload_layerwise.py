"""Loads that complete layer by layer, so that a step computes layer i while layer i+1 loads.

A CPU-tier hit moves every layer of the prefix's blocks from the arena into fresh GPU blocks,
and the step that follows reads layer i only in its layer i. Waiting for the whole copy before
the step would put the copy (bytes at the PCIe limit) and the step's compute end to end; loading
layer by layer lets them overlap, so a hit costs about the copy plus one layer of compute.

- CUDA: the copies run on a load stream, ordered after the work enqueued so far, layer 0 of
  every block first; one event per layer is recorded once that layer of every block is in
  place. The step waits on each layer's event right before the layer (the eager attention
  backend, or between per-layer CUDA graph segments: engine.step_graphs). Per layer, blocks
  whose slots and GPU block ids both follow on go as one 2-D DMA copy per run
  (``cudaMemcpy2DAsync``: rows of one layer's bytes, pitched by the block's bytes on both
  sides); scattered ones as one gather kernel through the mapped arena.
- CPU: nothing runs concurrently with the step, so each layer is copied when the step first
  waits for it; every layer left is copied before the next step (:meth:`LayerLoads.finish`).

Whatever happens, :meth:`LayerLoads.finish` leaves every load complete in stream order.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.offload_copy import ArenaBlocks
from engine.offload_cuda import CUDA_MEMCPY_DEFAULT, find_cuda_memcpy_2d, loaded_cudart


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


class _GroupPlan:
    """How one group's blocks move, layer by layer."""

    def __init__(self, load: GroupLoad, memcpy_2d: object | None) -> None:
        self.load = load
        kv, arena = load.kv, load.arena
        self.layers = int(kv.shape[1])
        self.block_bytes = kv[0].numel() * kv.element_size()
        if self.block_bytes % self.layers:
            raise ValueError(f"a block of {self.block_bytes} bytes does not split into {self.layers} layers")
        self.layer_bytes = self.block_bytes // self.layers
        self.dtype = _layer_dtype(self.layer_bytes, kv.dtype)
        if len(load.block_ids) != len(load.slots):
            raise ValueError(f"{len(load.block_ids)} blocks but {len(load.slots)} slots")
        spc = arena.geometry.slots_per_chunk
        pairs = sorted(zip(load.slots, load.block_ids, strict=True))
        for s, _ in (pairs[0], pairs[-1]):
            if not 0 <= s < arena.geometry.max_slots:
                raise IndexError(f"slot {s} outside [0, {arena.geometry.max_slots})")
        # Per chunk file: (slots inside the chunk, block ids), in slot order.
        self.chunks: dict[int, tuple[list[int], list[int]]] = {}
        for s, b in pairs:
            local, ids = self.chunks.setdefault(s // spc, ([], []))
            local.append(s % spc)
            ids.append(b)
        # Runs where the slot (inside one chunk) and the block id both go up by one:
        # [chunk, first local slot, first block id, length].
        runs: list[list[int]] = []
        for c, (local, ids) in self.chunks.items():
            for i, (s, b) in enumerate(zip(local, ids, strict=True)):
                if i and s == local[i - 1] + 1 and b == ids[i - 1] + 1:
                    runs[-1][3] += 1
                else:
                    runs.append([c, s, b, 1])
        cuda = kv.is_cuda
        pageable = cuda and any(arena.chunk_is_pageable(c) for c in self.chunks)
        self.dma = bool(cuda and memcpy_2d is not None and not pageable and len(runs) * 4 <= len(pairs))
        self.pageable = pageable
        self.dma_runs = [(arena.host_chunk(c).data_ptr() + s * self.block_bytes,
                          kv.data_ptr() + b * self.block_bytes, n) for c, s, b, n in runs] if self.dma else []
        # Gather path: per chunk, the source as [slots, layers, elements] (the device alias on
        # CUDA) and the two index tensors, made once for every layer.
        self._gathers: list[tuple[Tensor, Tensor, Tensor]] = []
        self._dst: Tensor | None = None

    def _prepare_gathers(self) -> None:
        kv, arena = self.load.kv, self.load.arena
        dev = kv.device
        self._dst = kv.view(kv.shape[0], -1).view(torch.uint8).view(kv.shape[0], self.layers, -1).view(self.dtype)
        for c, (local, ids) in self.chunks.items():
            view = arena.device_chunk(c) if kv.is_cuda and not self.pageable else arena.host_chunk(c)
            src = view.view(torch.uint8).view(view.shape[0], self.layers, -1).view(self.dtype)
            local_t = arena.index(local, torch.device("cpu") if self.pageable else dev)
            self._gathers.append((src, local_t, arena.index(ids, dev)))

    def copy_layer(self, li: int, memcpy_2d: Callable[..., int] | None = None,
                   handle: ctypes.c_void_p | None = None) -> None:
        """Enqueue (CUDA: on ``handle``'s stream for DMA, else on the current stream) or do
        (CPU) the copy of layer ``li`` of every block."""
        if self.dma:
            assert memcpy_2d is not None
            off, bb, lb = li * self.layer_bytes, self.block_bytes, self.layer_bytes
            for src_ptr, dst_ptr, n in self.dma_runs:
                err = memcpy_2d(dst_ptr + off, bb, src_ptr + off, bb, lb, n, CUDA_MEMCPY_DEFAULT, handle)
                if err != 0:
                    raise RuntimeError(f"cudaMemcpy2DAsync of layer {li} failed: error {err}")
            return
        if self._dst is None:
            self._prepare_gathers()
        assert self._dst is not None
        dst = self._dst[:, li]
        for src, local, ids in self._gathers:
            rows = src[:, li].index_select(0, local)
            dst.index_copy_(0, ids, rows.to(dst.device) if self.pageable else rows)


class LayerLoads:
    """The loads issued for one step; the step calls :meth:`wait_layer` before each layer."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._events: dict[tuple[int, int], torch.cuda.Event] = {}
        self._pending: list[tuple[_GroupPlan, list[bool]]] = []  # plans and the layers done (CPU)
        self.copy_seconds = 0.0
        """CPU: time spent in the deferred copies so far."""

    def wait_layer(self, group_idx: int, layer: int) -> None:
        """Make what follows on the current stream (CUDA) or in this thread (CPU) see every
        block of layer ``layer`` of group ``group_idx`` loaded."""
        if self.is_cuda:
            ev = self._events.get((group_idx, layer))
            if ev is not None:
                torch.cuda.current_stream(self.device).wait_event(ev)
            return
        for plan, done in self._pending:
            if plan.load.group_idx == group_idx and not done[layer]:
                self._copy(plan, layer)
                done[layer] = True

    def finish(self) -> None:
        """Every load complete in stream order (CUDA) or done (CPU): after the step, or when a
        step did not wait for some layer."""
        if self.is_cuda:
            current = torch.cuda.current_stream(self.device)
            for ev in self._events.values():
                current.wait_event(ev)
            self._events.clear()
            self._pending.clear()  # new allocations on any stream now follow the copies
            return
        for plan, done in self._pending:
            for li in range(plan.layers):
                if not done[li]:
                    self._copy(plan, li)
                    done[li] = True
        self._pending.clear()

    def _copy(self, plan: _GroupPlan, layer: int) -> None:
        t0 = time.perf_counter()
        plan.copy_layer(layer)
        self.copy_seconds += time.perf_counter() - t0

    @property
    def empty(self) -> bool:
        return not self._events and not self._pending


class LayerLoader:
    """Issues layer-by-layer loads on one load stream (CUDA) or defers them per layer (CPU)."""

    def __init__(self, device: torch.device, num_streams: int = 2) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        # Layers alternate between the streams: one layer's copies start while the previous
        # layer's last one drains, hiding the gap each DMA copy leaves behind it.
        self._streams = [torch.cuda.Stream(device) for _ in range(num_streams)] if self.is_cuda else []
        self._handles = [ctypes.c_void_p(int(st.cuda_stream)) for st in self._streams]
        # One event per (group, layer), recorded again by every load: a step's waits are
        # enqueued before the next load records it again, and two loads of one step record
        # it on the same stream, in order.
        self._events: dict[tuple[int, int], torch.cuda.Event] = {}
        self._memcpy_2d = find_cuda_memcpy_2d(loaded_cudart()) if self.is_cuda else None
        self.issued: dict[str, int] = {}
        """Group loads issued per path: ``dma`` (2-D copies of runs) or ``kernel`` (gather)."""

    def load(self, groups: Sequence[GroupLoad], into: LayerLoads,
             timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None) -> torch.cuda.Event | None:
        """Start loading every group's blocks, layer 0 of all groups first; ``into`` gets the
        per-layer events (CUDA) or the deferred copies (CPU). Returns the event recorded after
        the last copy (CUDA; ``timing``, if given, is recorded around the copies). Bad slots
        raise before anything is issued."""
        plans = [_GroupPlan(g, self._memcpy_2d) for g in groups if len(g.block_ids)]
        if not plans:
            return None
        for p in plans:
            path = "dma" if p.dma else "kernel"
            self.issued[path] = self.issued.get(path, 0) + 1
        if not self.is_cuda:
            into._pending.extend((p, [False] * p.layers) for p in plans)
            return None
        # Kept until finish(): the gather path's index tensors are read by both load streams.
        into._pending.extend((p, [True] * p.layers) for p in plans)
        streams = self._streams
        current = torch.cuda.current_stream(self.device)
        for st in streams:
            # The fresh blocks may still be read by work already enqueued (a step that freed them).
            st.wait_stream(current)
        if timing is not None:
            timing[0].record(streams[0])
        # The issuing loop is on the host's critical path (the step launches after it): no
        # stream contexts or new events for DMA copies, only the copies and one record.
        events, memcpy_2d = self._events, self._memcpy_2d
        for li in range(max(p.layers for p in plans)):
            k = li % len(streams)
            st = streams[k]
            for p in plans:
                if li >= p.layers:
                    continue
                if p.dma:
                    p.copy_layer(li, memcpy_2d, self._handles[k])
                else:
                    with torch.cuda.stream(st):
                        p.copy_layer(li)
                key = (p.load.group_idx, li)
                ev = events.get(key)
                if ev is None:
                    ev = events[key] = torch.cuda.Event()
                ev.record(st)
                into._events[key] = ev
        for st in streams[1:]:
            streams[0].wait_stream(st)
        if timing is not None:
            timing[1].record(streams[0])
            return timing[1]
        return streams[0].record_event()
