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
- CUDA, ``batch`` mode: the same DMA copies, all issued with one ``cudaMemcpyBatchAsync``
  (CUDA >= 12.8 runtime; else ``memcpy``).
- CUDA, ``mixed`` mode: a share of the blocks (``dma_share``) goes by DMA (``batch`` when
  available, else per-run memcpy) on a side stream while the rest goes by the zero-copy kernel
  on the current stream, so PCIe stays busy through the copy engine's per-copy gaps.
- CUDA, ``auto`` (default): per call, all by DMA when the slots come in runs, else ``mixed``.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.offload.config import COPY_MODES
from engine.offload.cuda_runtime import (
    CUDA_HOST_REGISTER_PORTABLE_MAPPED,
    CudaArray,
    DmaCopier,
    find_cuda_batch_memcpy,
    find_cuda_memcpy,
    loaded_cudart,
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


def _num_runs(sorted_slots: Tensor) -> int:
    """How many runs of consecutive slots an ascending tensor holds."""
    return int((sorted_slots.diff() != 1).sum()) + 1 if len(sorted_slots) else 0


class ArenaBlocks:
    """One group's arena, as tensors shaped like the group's blocks."""

    def __init__(
        self, mapping: ArenaMapping, block_shape: Sequence[int], dtype: torch.dtype,
        device: torch.device, copy_mode: str = "auto", num_dma_streams: int = 1,
        dma_share: float = 0.75, batch_flags: int = 0,
    ) -> None:
        if copy_mode not in COPY_MODES:
            raise ValueError(f"copy_mode must be one of {', '.join(COPY_MODES)}; got {copy_mode!r}")
        if num_dma_streams < 1:
            raise ValueError(f"num_dma_streams must be >= 1, got {num_dma_streams}")
        if not 0.0 <= dma_share <= 1.0:
            raise ValueError(f"dma_share must be within [0, 1], got {dma_share}")
        self.mapping = mapping
        self.geometry = mapping.geometry
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = dtype
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.num_dma_streams = num_dma_streams
        self.dma_share = dma_share
        lib = loaded_cudart() if self.is_cuda else None
        self._memcpy = find_cuda_memcpy(lib) if lib is not None else None
        self._batch = (find_cuda_batch_memcpy(lib, batch_flags)
                       if lib is not None and copy_mode in ("batch", "mixed", "auto") else None)
        if self.is_cuda and copy_mode == "batch" and self._batch is None:
            log.warning("cudaMemcpyBatchAsync needs a CUDA >= 12.8 runtime: copy_mode batch falls back to memcpy")
            copy_mode = "memcpy"
        if copy_mode == "memcpy" and self._memcpy is None:
            copy_mode = "kernel"
        self.copy_mode = copy_mode
        self._dma = DmaCopier(device, num_dma_streams, self._memcpy, self._batch)
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

    def chunk_is_pageable(self, chunk: int) -> bool:
        """True when the chunk could not be registered with CUDA (copies go at pageable speed)."""
        self.host_chunk(chunk)
        return chunk in self._pageable

    def index(self, values: Sequence[int] | Tensor, device: torch.device) -> Tensor:
        """An int64 index tensor on ``device`` (from pinned memory on CUDA)."""
        t = values if isinstance(values, Tensor) else torch.tensor(list(values), dtype=torch.long)
        if device.type == "cuda" and not t.is_cuda:
            # From pinned memory: a copy from pageable memory may wait for the stream's earlier
            # work (here: the DMA of the whole load), stalling the thread that issues the step.
            t = t.pin_memory()
        return t.to(device, non_blocking=True)

    # -- store: KV tensor -> staging (in stream order), staging -> slots (anywhere later) ---

    def gather(self, kv: Tensor, block_ids: Sequence[int]) -> Tensor:
        """Snapshot blocks into a new tensor: after this (in stream order) the blocks may be reused."""
        return self._flat(kv).index_select(0, self.index(block_ids, kv.device))

    def write(self, staging: Tensor, slots: Sequence[int]) -> None:
        """``slot[slots[i]] = staging[i]``; on CUDA enqueued on the current stream."""
        if not slots:
            return
        for b in self._by_chunk(slots):
            rows = staging if b.positions is None else staging[self.index(b.positions, staging.device)]
            host = self.host_chunk(b.chunk)
            if not self.is_cuda:
                host.index_copy_(0, b.local, rows)
            elif b.chunk in self._pageable:
                host.index_copy_(0, b.local, rows.cpu())
            else:
                self._write_cuda(b.chunk, host, rows, b.local)

    def _write_cuda(self, chunk: int, host: Tensor, rows: Tensor, local: Tensor) -> None:
        srt, order = torch.sort(local)
        k, n, dev = self._dma_count(srt), len(srt), rows.device
        if k == 0:
            self.device_chunk(chunk).index_copy_(0, self.index(local, dev), rows)
            return
        # ``rows`` stays referenced until the join: the DMA streams read it.
        if k == n:
            # All by DMA: reorder the rows by slot so that adjacent slots make one copy.
            if not torch.equal(order, torch.arange(n)):
                rows = rows[self.index(order, dev)]
            rows = rows.contiguous()
            self._dma.copy(host, rows, srt, torch.arange(n), to_host=True)
        else:
            # Mixed: DMA straight from the caller's rows (one copy per run where rows and slots
            # both follow on) while the kernel moves the rest on the current stream.
            rows = rows.contiguous()
            self._dma.copy(host, rows, srt[:k], order[:k], to_host=True)
            rest = self.index(order[k:], dev)
            self.device_chunk(chunk).index_copy_(0, self.index(srt[k:], dev), rows[rest])
        self._dma.join()

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
                self._read_cuda(kv, b.chunk, host, ids, b.local)
                continue
            self._flat(kv).index_copy_(0, self.index(ids, kv.device), src)

    def _read_cuda(self, kv: Tensor, chunk: int, host: Tensor, ids: Tensor, local: Tensor) -> None:
        srt, order = torch.sort(local)
        k, n, flat = self._dma_count(srt), len(srt), self._flat(kv)
        if k == 0:
            src = self.device_chunk(chunk).index_select(0, self.index(local, kv.device))
            flat.index_copy_(0, self.index(ids, kv.device), src)
            return
        ids = ids[order]
        # The DMA fills a staging tensor in slot order (so adjacent slots make one copy) on
        # side streams; the kernel loads the rest straight into the KV tensor meanwhile.
        staging = torch.empty((k, host.shape[1]), dtype=self.wide, device=kv.device)
        self._dma.copy(host, staging, srt[:k], torch.arange(k), to_host=False)
        if k < n:
            rest = self.device_chunk(chunk).index_select(0, self.index(srt[k:], kv.device))
            flat.index_copy_(0, self.index(ids[k:], kv.device), rest)
        self._dma.join()
        flat.index_copy_(0, self.index(ids[:k], kv.device), staging)

    def _scratch(self, rows: int, cols: int) -> Tensor:
        """A reused CPU buffer: a fresh large tensor per load costs its page faults, which
        cut a CPU load from ~8 to ~2 GB/s on the CI machine."""
        if self._cpu_scratch is None or self._cpu_scratch.shape[0] < rows:
            self._cpu_scratch = torch.empty((rows, cols), dtype=self.wide)
        return self._cpu_scratch[:rows]

    @property
    def dma_path(self) -> str:
        """How DMA copies are issued now: ``batch``, ``memcpy`` (ctypes) or ``torch`` (copy_)."""
        return "batch" if self._dma.batch else "memcpy" if self._dma.memcpy else "torch"

    def _dma_count(self, sorted_local: Tensor) -> int:
        """How many of the call's blocks (the first in slot order) go by DMA; the rest go by
        the zero-copy kernel.

        ``auto``: all by DMA when slots come in runs (fresh reservations usually do), else
        ``mixed`` (DMA for ``dma_share`` of the blocks, the kernel for the rest at once).
        Measured on the H200 with 512 KiB blocks at random slots: a DMA copy costs ~3 us beyond
        its bytes (0.79 of the limit one by one, 0.88/0.92 store/load in one batch call), the
        kernel alone 0.88/0.86, both together 0.90/0.91; runs of 4+ blocks make DMA alone the
        fastest (0.92; docs/BENCHMARKS.md)."""
        n = len(sorted_local)
        if self.copy_mode == "kernel":
            return 0
        if self.copy_mode in ("memcpy", "batch"):
            return n
        if self.copy_mode == "mixed":
            return round(self.dma_share * n)
        if self._memcpy is None:
            return 0
        return n if _num_runs(sorted_local) * 4 <= n else round(self.dma_share * n)

    def close(self) -> None:
        self._dev.clear()
        self._host.clear()
        if self.is_cuda:
            for base in self._registered:
                torch.cuda.cudart().cudaHostUnregister(base)
        self._registered.clear()
