"""Batched copies between one KV-cache group's block tensor and its offloadd arena slots.

A slot holds one block of one group across all its layers, with the byte layout of
``tensor[block_id]``, so a block moves as one contiguous piece. Every copy here is batched: one
gather or scatter per chunk file per call, never one call per block.

- CPU: the chunk files are plain shared memory; a chunk is viewed as a tensor
  ``[slots_per_chunk, *block_shape]`` (``torch.frombuffer`` over the mapping), and a store is one
  ``index_copy_`` into it, a load one ``index_select`` + ``index_copy_`` out of it.
- CUDA, ``kernel`` mode: each chunk is registered with ``cudaHostRegister`` (portable, mapped),
  and a CUDA tensor aliases it (``__cuda_array_interface__``), so one gather/scatter kernel moves
  every block of the step over PCIe, scattered slots included.
- CUDA, ``memcpy`` mode: blocks are ordered by
  slot and moved with one DMA ``cudaMemcpyAsync`` per run of adjacent slots between the arena
  and a device staging tensor, plus one gather/scatter kernel on the device side.
- CUDA, ``auto`` (default): per call, ``memcpy`` when the slots come in runs, else ``kernel``.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.offload_cuda import (
    CUDA_HOST_REGISTER_PORTABLE_MAPPED,
    CUDA_MEMCPY_DEFAULT,
    CudaArray,
    find_cuda_memcpy,
)
from offloadd.client import ArenaGeometry, ArenaMapping, GroupArenaInfo

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class _Batch:
    """One chunk file's share of a copy: slot indices inside the chunk, and their positions in
    the caller's lists (None: all of them, in order)."""

    chunk: int
    local: Tensor
    positions: Tensor | None


def _runs(sorted_slots: Tensor) -> list[tuple[int, int, int]]:
    """:func:`slot_runs` of an ascending tensor, with vector ops."""
    n = len(sorted_slots)
    if n == 0:
        return []
    starts = [0, *((sorted_slots.diff() != 1).nonzero().flatten() + 1).tolist()]
    first = sorted_slots[starts].tolist()
    return [(a, f, b - a) for a, f, b in zip(starts, first, [*starts[1:], n], strict=True)]


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first position, first slot, length)`` of each run of consecutive slots, in order."""
    runs: list[tuple[int, int, int]] = []
    for pos, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            p, s, n = runs[-1]
            runs[-1] = (p, s, n + 1)
        else:
            runs.append((pos, slot, 1))
    return runs


class ArenaBlocks:
    """One group's arena, as tensors shaped like the group's blocks."""

    def __init__(
        self, mapping: ArenaMapping, block_shape: Sequence[int], dtype: torch.dtype,
        device: torch.device, copy_mode: str = "auto", num_dma_streams: int = 1,
    ) -> None:
        self.mapping = mapping
        self.geometry = mapping.geometry
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = dtype
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._memcpy = find_cuda_memcpy() if self.is_cuda else None
        self.num_dma_streams = num_dma_streams
        self._dma_streams: list[torch.cuda.Stream] = []
        self.copy_mode = copy_mode if copy_mode != "memcpy" or self._memcpy is not None else "kernel"
        nbytes = torch.empty((), dtype=dtype).element_size()
        for d in self.block_shape:
            nbytes *= d
        if nbytes != self.geometry.slot_bytes:
            raise ValueError(f"block is {nbytes} bytes but the arena slot is {self.geometry.slot_bytes}")
        # Copies move each block as wide elements (16 or 8 bytes) whatever the KV dtype: fewer,
        # wider accesses; this matters most for kernels that read or write host memory over PCIe.
        self.wide = next(
            (w for w, n in ((torch.complex128, 16), (torch.int64, 8)) if self.geometry.slot_bytes % n == 0),
            dtype,
        )
        self._host: dict[int, Tensor] = {}
        self._dev: dict[int, Tensor] = {}
        self._pageable: set[int] = set()
        self._cpu_scratch: Tensor | None = None
        self._registered: list[int] = []

    @classmethod
    def in_engine_blocks(cls, info: GroupArenaInfo, k: int, kv: Tensor, copy_mode: str) -> ArenaBlocks:
        """A group's arena seen in engine blocks: daemon slot s = sub-slots s*k .. s*k+k-1
        (the chunk files are the same bytes either way)."""
        geometry = ArenaGeometry(info.slot_bytes // k, info.slots_per_chunk * k, info.max_slots * k,
                                 info.chunk_path_template)
        return cls(ArenaMapping(geometry), kv.shape[1:], kv.dtype, kv.device, copy_mode)

    # -- views --------------------------------------------------------------------------

    def _base(self, chunk: int) -> int:
        return self.mapping.address(chunk * self.geometry.slots_per_chunk)

    def _flat(self, kv: Tensor) -> Tensor:
        """The KV tensor as ``[num_blocks, wide elements per block]`` (same memory)."""
        return kv.view(kv.shape[0], -1).view(self.wide)

    def host_chunk(self, chunk: int) -> Tensor:
        """The chunk file as a CPU tensor ``[slots_per_chunk, wide elements]`` (shared memory)."""
        view = self._host.get(chunk)
        if view is None:
            nbytes = self.geometry.chunk_file_bytes
            base = self._base(chunk)
            buf = (ctypes.c_char * nbytes).from_address(base)
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)  # keeps buf alive
            view = raw.view(self.wide).view(self.geometry.slots_per_chunk, -1)
            if self.is_cuda:
                err = int(torch.cuda.cudart().cudaHostRegister(base, nbytes, CUDA_HOST_REGISTER_PORTABLE_MAPPED))
                if err == 0:
                    self._registered.append(base)
                else:  # e.g. a file on a disk filesystem: correct, but at pageable speed
                    log.warning("cudaHostRegister of arena chunk %d failed (error %d): pageable copies", chunk, err)
                    self._pageable.add(chunk)
            self._host[chunk] = view
        return view

    def device_chunk(self, chunk: int) -> Tensor:
        """CUDA alias of the registered chunk (unified addressing: same pointer as the host)."""
        view = self._dev.get(chunk)
        if view is None:
            host = self.host_chunk(chunk)
            raw = torch.as_tensor(
                CudaArray(host.data_ptr(), self.geometry.chunk_file_bytes), device=self.device
            )
            view = raw.view(self.wide).view(self.geometry.slots_per_chunk, -1)
            self._dev[chunk] = view
        return view

    def _by_chunk(self, slots: Sequence[int]) -> list[_Batch]:
        """Slots grouped by chunk file, with vector ops (no per-block Python on the hot path)."""
        s = torch.as_tensor(list(slots), dtype=torch.long)
        lo, hi = int(s.min()), int(s.max())
        if lo < 0 or hi >= self.geometry.max_slots:
            raise IndexError(f"slot {lo if lo < 0 else hi} outside [0, {self.geometry.max_slots})")
        spc = self.geometry.slots_per_chunk
        if lo // spc == hi // spc:
            return [_Batch(lo // spc, s - (lo // spc) * spc, None)]
        chunk = s // spc
        out = []
        for c in torch.unique(chunk).tolist():
            pos = (chunk == c).nonzero().flatten()
            out.append(_Batch(int(c), s[pos] - int(c) * spc, pos))
        return out

    def _index(self, values: Sequence[int] | Tensor, device: torch.device) -> Tensor:
        t = values if isinstance(values, Tensor) else torch.tensor(list(values), dtype=torch.long)
        return t.to(device, non_blocking=True)

    # -- store: KV tensor -> staging (in stream order), staging -> slots (anywhere later) ---

    def gather(self, kv: Tensor, block_ids: Sequence[int]) -> Tensor:
        """Snapshot blocks into a new tensor: after this (in stream order) the blocks may be reused."""
        return self._flat(kv).index_select(0, self._index(block_ids, kv.device))

    def write(self, staging: Tensor, slots: Sequence[int]) -> None:
        """``slot[slots[i]] = staging[i]``; on CUDA enqueued on the current stream."""
        if not slots:
            return
        for b in self._by_chunk(slots):
            rows = staging if b.positions is None else staging[self._index(b.positions, staging.device)]
            host = self.host_chunk(b.chunk)
            if not self.is_cuda:
                host.index_copy_(0, b.local, rows)
            elif b.chunk in self._pageable:
                host.index_copy_(0, b.local, rows.cpu())
            else:
                srt, order = torch.sort(b.local)
                if self._use_kernel(srt):
                    self.device_chunk(b.chunk).index_copy_(0, self._index(b.local, staging.device), rows)
                    continue
                if not torch.equal(order, torch.arange(len(order))):
                    rows = rows[self._index(order, rows.device)]
                self._dma(host, rows.contiguous(), srt, to_host=True)

    # -- load: slots -> KV tensor, one scatter per chunk --------------------------------

    def read(self, kv: Tensor, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        """``kv[block_ids[i]] = slot[slots[i]]``; on CUDA enqueued on the current stream."""
        if len(block_ids) != len(slots):
            raise ValueError(f"{len(block_ids)} blocks but {len(slots)} slots")
        if not slots:
            return
        all_ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        for b in self._by_chunk(slots):
            ids = all_ids if b.positions is None else all_ids[b.positions]
            host = self.host_chunk(b.chunk)
            if not self.is_cuda:
                src = torch.index_select(host, 0, b.local, out=self._scratch(len(b.local), host.shape[1]))
            elif b.chunk in self._pageable:
                src = host.index_select(0, b.local).to(kv.device)
            else:
                srt, order = torch.sort(b.local)
                if self._use_kernel(srt):
                    src = self.device_chunk(b.chunk).index_select(0, self._index(b.local, kv.device))
                else:
                    ids = ids[order]
                    src = torch.empty((len(srt), host.shape[1]), dtype=self.wide, device=kv.device)
                    self._dma(host, src, srt, to_host=False)
            self._flat(kv).index_copy_(0, self._index(ids, kv.device), src)

    def _scratch(self, rows: int, cols: int) -> Tensor:
        """A reused CPU buffer: a fresh large tensor per load costs its page faults, which
        cut a CPU load from ~8 to ~2 GB/s on the CI machine."""
        if self._cpu_scratch is None or self._cpu_scratch.shape[0] < rows:
            self._cpu_scratch = torch.empty((rows, cols), dtype=self.wide)
        return self._cpu_scratch[:rows]

    def _use_kernel(self, sorted_local: Tensor) -> bool:
        """``auto``: DMA when slots come in runs (fresh reservations usually do), else one kernel.

        Measured on the H200 with 512 KiB blocks: a DMA copy costs ~3 us beyond its bytes, so
        single-block copies reach ~0.77 of the limit and the kernel ~0.84; runs of 4+ blocks
        make DMA the faster one (docs/BENCHMARKS.md)."""
        if self.copy_mode != "auto":
            return self.copy_mode == "kernel"
        if self._memcpy is None:
            return True
        return len(_runs(sorted_local)) * 4 > len(sorted_local)

    def _dma(self, host: Tensor, dev: Tensor, sorted_local: Tensor, to_host: bool) -> None:
        """One async copy per run of adjacent slots between ``host[local]`` and ``dev`` rows.

        Through cudaMemcpyAsync by ctypes when libcudart is loaded (about 1 us of Python per
        copy, so the copy engine, not the interpreter, sets the pace), else tensor ``copy_``."""
        slot_bytes = self.geometry.slot_bytes
        runs = _runs(sorted_local)
        if self._memcpy is None:
            for pos, slot, n in runs:
                if to_host:
                    host[slot : slot + n].copy_(dev[pos : pos + n], non_blocking=True)
                else:
                    dev[pos : pos + n].copy_(host[slot : slot + n], non_blocking=True)
            return
        # Copies round-robin over several streams: each copy engine transfer has a fixed gap,
        # and concurrent copies hide it (the streams first wait for the current one, which then
        # waits for all of them).
        current = torch.cuda.current_stream(self.device)
        if not self._dma_streams:
            self._dma_streams = [torch.cuda.Stream(self.device) for _ in range(self.num_dma_streams)]
        ready = current.record_event()
        handles = []
        for st in self._dma_streams:
            st.wait_event(ready)
            handles.append(ctypes.c_void_p(st.cuda_stream))
        hbase, dbase = host.data_ptr(), dev.data_ptr()
        memcpy = self._memcpy
        for i, (pos, slot, n) in enumerate(runs):
            h, d = hbase + slot * slot_bytes, dbase + pos * slot_bytes
            err = memcpy(h if to_host else d, d if to_host else h, n * slot_bytes, CUDA_MEMCPY_DEFAULT,
                         handles[i % len(handles)])
            if err != 0:
                raise RuntimeError(f"cudaMemcpyAsync failed: error {err}")
        for st in self._dma_streams:
            current.wait_stream(st)

    def close(self) -> None:
        self._dev.clear()
        self._host.clear()
        if self.is_cuda:
            for base in self._registered:
                torch.cuda.cudart().cudaHostUnregister(base)
        self._registered.clear()
