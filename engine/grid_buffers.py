"""A grid step's shape and rows (engine.step_graphs), and the static input buffers of one
shape (:class:`GridInputs`): what the host writes each step and the device tensor the step's
graph reads, in two pinned buffers on CUDA so that the host fills one while a step launched
earlier may still read the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.offload.cuda_runtime import CudaArray


@dataclass(frozen=True)
class GridShape:
    rows: int  # R: request rows
    queries: int  # Q: query slots per row
    blocks: tuple[int, ...]  # NB per group: blocks read per row


@dataclass(frozen=True)
class GridRow:
    """One scheduled request in grid terms (host side)."""

    token_ids: Sequence[int]
    start: int  # position of the first token computed in this step
    tables: Sequence[Sequence[int]]  # per group: the request's block table


class GridInputs:
    """The static inputs of one shape: what the host writes each step, and the int64 device
    tensor the step reads (:meth:`flat`).

    On CUDA the host writes one of two pinned buffers in turn, and one conversion kernel (no
    copy-engine work, so a step never queues behind the DMA copies of a load it overlaps,
    engine.offload.layerwise) reads it over PCIe into the device tensor ahead of the graph.
    Two buffers: the host fills one while a step launched earlier may still be reading the
    other (the engine launches a decode step before the last one's tokens are read)."""

    def __init__(self, shape: GridShape, device: torch.device) -> None:
        r, q = shape.rows, shape.queries
        sizes = [("ids", r * q), ("start", r), ("count", r), ("ends", r)]
        for g, nb in enumerate(shape.blocks):
            sizes += [(f"lo{g}", r), (f"gather{g}", r * nb)]
        self.offsets: dict[str, tuple[int, int]] = {}
        total = 0
        for name, n in sizes:
            self.offsets[name] = (total, n)
            total += n
        self.cuda = device.type == "cuda"
        turns = 2 if self.cuda else 1
        self.hosts = [torch.zeros(total, dtype=torch.int32, pin_memory=self.cuda) for _ in range(turns)]
        # The host writes through numpy views of the same memory: a list of ~300 ints into
        # one costs ~8 us, where torch.tensor(list) and a copy_ cost ~30 (~0.1 ms on an H200 host).
        self.arrays = [h.numpy() for h in self.hosts]
        # Pinned (cudaHostAlloc) memory is mapped at the same address for the device (UVA).
        self.srcs = ([torch.as_tensor(CudaArray(h.data_ptr(), total * 4), device=device).view(torch.int32)
                      for h in self.hosts] if self.cuda else self.hosts)
        # One event per buffer, recorded again each turn (a new event per step cost a create).
        self.read = [torch.cuda.Event() for _ in range(turns)] if self.cuda else []
        self.recorded = [False] * turns
        self.turn = 0
        self.dev = torch.zeros(total, dtype=torch.long, device=device)

    def flat(self) -> Tensor:
        """Every input as one int64 device tensor (static: a graph reads it at each replay)."""
        return self.dev

    def part(self, flat: Tensor, name: str) -> Tensor:
        off, n = self.offsets[name]
        return flat[off : off + n]

    def upload(self, values: list[int], ids: Tensor | None = None, settled: bool = False) -> None:
        """Queue this step's inputs ahead of its work; :meth:`launched` follows the step's launch.
        ``ids``: the first ``len(ids)`` token ids (one query slot per row) come from this device
        tensor, not from ``values``. ``settled``: every step launched before has completed
        (the caller read its results), so no buffer is still being read: nothing to wait for."""
        turn = self.turn
        self.turn = (turn + 1) % len(self.hosts)
        if self.recorded[turn] and not settled:
            self.read[turn].synchronize()  # the step before last has read this buffer
        self.arrays[turn][:] = values
        self.dev.copy_(self.srcs[turn])
        if ids is not None:
            off = self.offsets["ids"][0]
            self.dev[off : off + ids.numel()].copy_(ids)

    def launched(self) -> None:
        """Mark the buffer of the last upload as read once the step just launched is done: the
        event is recorded behind the whole step, after its launch, so that the host makes this
        call while the GPU works, not before the step starts (on an H200 host a record after
        ~20 ms idle took ~0.08 ms)."""
        if self.cuda:
            turn = (self.turn - 1) % len(self.hosts)
            self.read[turn].record()
            self.recorded[turn] = True
