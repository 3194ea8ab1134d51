"""Loads that complete layer by layer, so that a step computes layer i while layer i+1 loads.

A CPU-tier hit moves every layer of the prefix's blocks from the arena into fresh GPU blocks,
and the step that follows reads layer i only in its layer i. Waiting for the whole copy before
the step would put the copy (bytes at the PCIe limit) and the step's compute end to end; loading
layer by layer lets them overlap, so a hit costs about the copy plus one layer of compute.

- CUDA: the copies run on one load stream, in layer order, ordered after the work enqueued
  so far, layer 0 of every block first, in units of layers that halve toward the last layer
  (engine.offload.layer_plan.copy_units; 16 layers: 8, 4, 2, 1, 1); one event per unit is
  recorded once its layers of every block are in place. The step waits on its layer's unit
  right before the layer (the eager attention backend, or between per-layer CUDA graph
  segments: engine.step_graphs). The units starting within ``LOOKAHEAD_LAYERS`` layers are issued at
  admission and each wait issues those starting within that many layers after it, so the host
  launches the step's first layers right after the first copies. Per unit, blocks whose slots
  and GPU block ids both follow on go as one 2-D DMA copy per run (``cudaMemcpy2DAsync``: rows
  of the unit's bytes, pitched by the block's bytes on both sides); scattered ones as one
  gather kernel through the mapped arena.
  How each group's blocks are planned and copied is engine.offload.layer_plan.
- CPU: nothing runs concurrently with the step, so each layer is copied when the step first
  waits for it; every layer left is copied before the next step (:meth:`LayerLoads.finish`).

Whatever happens, :meth:`LayerLoads.finish` leaves every load complete in stream order.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence

import torch

from engine.offload.cuda_runtime import find_cuda_memcpy_2d, loaded_cudart
from engine.offload.layer_plan import GroupLoad, GroupPlan

LOOKAHEAD_LAYERS = 4
"""CUDA: units starting within this many layers after the layer the step waits for are issued
ahead of it. The rest are issued from the step's own waits, so that its first layers launch
right after the first copies instead of after all of them (the host issues both in turn)."""


class _Pending:
    """A plan of this step, and how far it got: layers issued (CUDA) or copied (CPU)."""

    def __init__(self, plan: GroupPlan) -> None:
        self.plan = plan
        self.next = 0  # CUDA: units [0, next) issued
        self.copied = [False] * plan.layers  # CPU


class LayerLoads:
    """One step's loads; the step calls :meth:`wait_layer` before each layer, and
    :meth:`finish` after the step (whatever it did)."""

    def __init__(self, loader: LayerLoader) -> None:
        self.loader = loader
        self.device = loader.device
        self.is_cuda = loader.is_cuda
        self._events: dict[tuple[int, int], torch.cuda.Event] = {}
        self._pending: list[_Pending] = []
        self._issued_upto = 0  # CUDA: layers below this are issued for every plan
        self._timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self.copy_seconds = 0.0
        """CPU: time spent in the deferred copies so far."""

    @property
    def empty(self) -> bool:
        return not self._pending

    def add(self, plans: Sequence[GroupPlan], timing: tuple[torch.cuda.Event, torch.cuda.Event] | None) -> None:
        pending = [_Pending(p) for p in plans]
        if not self.is_cuda or not pending:
            self._pending.extend(pending)
            return
        # Every load of the step orders the load stream after the current stream: the fresh
        # blocks may still be read by work enqueued before, and the plan's own index uploads.
        self.loader.start(timing if not self._pending else None)
        if not self._pending:
            self._timing = timing
        self._pending.extend(pending)
        for x in pending:  # catch up with the plans added earlier in this step
            self._issue(x, self._issued_upto)
        self._issue_upto(LOOKAHEAD_LAYERS)

    def _issue(self, x: _Pending, upto: int) -> None:
        """Issue the plan's units that start below layer ``upto``."""
        units = x.plan.units
        while x.next < len(units) and units[x.next][0] < upto:
            a, b = units[x.next]
            ev = self.loader.issue(x.plan, a, b)
            for li in range(a, b):
                self._events[(x.plan.load.group_idx, li)] = ev
            x.next += 1

    def _issue_upto(self, layer: int) -> None:
        if layer <= self._issued_upto:
            return
        for li in range(self._issued_upto, layer):
            for x in self._pending:
                self._issue(x, li + 1)
        self._issued_upto = layer

    def wait_layer(self, group_idx: int, layer: int) -> None:
        """Make what follows on the current stream (CUDA) or in this thread (CPU) see every
        block of layer ``layer`` of group ``group_idx`` loaded."""
        if self.is_cuda:
            self._issue_upto(layer + 1 + LOOKAHEAD_LAYERS)
            ev = self._events.get((group_idx, layer))
            if ev is not None:
                torch.cuda.current_stream(self.device).wait_event(ev)
            return
        for x in self._pending:
            if x.plan.load.group_idx == group_idx and not x.copied[layer]:
                self._copy(x, layer)

    def finish(self) -> torch.cuda.Event | None:
        """Every load issued and complete in stream order (CUDA) or done (CPU): after the
        step, or when a step did not wait for some layer. CUDA: returns an event that
        completes after every copy (None when there was nothing to load)."""
        if not self._pending:
            return None
        if not self.is_cuda:
            for x in self._pending:
                for li in range(x.plan.layers):
                    if not x.copied[li]:
                        self._copy(x, li)
            self._pending.clear()
            return None
        self._issue_upto(max(x.plan.layers for x in self._pending))
        done = self.loader.join(self._timing)  # after every copy on the load stream
        torch.cuda.current_stream(self.device).wait_event(done)
        self._events.clear()
        self._pending.clear()  # new allocations on any stream now follow the copies
        self._issued_upto = 0
        self._timing = None
        return done

    def _copy(self, x: _Pending, layer: int) -> None:
        t0 = time.perf_counter()
        x.plan.copy_layers(layer, layer + 1)
        x.copied[layer] = True
        self.copy_seconds += time.perf_counter() - t0


class LayerLoader:
    """Plans loads and issues their layers on a load stream (CUDA); on CPU the copies are
    deferred to the step's waits."""

    def __init__(self, device: torch.device, halving: bool = True) -> None:
        self.device = device
        self.halving = halving
        """CUDA: copy in units that halve toward the last layer
        (engine.offload.layer_plan.copy_units); False: one copy per layer."""
        self.is_cuda = device.type == "cuda"
        # One stream, layers in order. With two (layers alternating, to hide each copy's tail)
        # the copy engine did not keep the layers in order, and the step, which waits for them
        # in order, stalled 0.5-0.75 ms mid-way for a layer that came late (H200 timeline).
        self._stream = torch.cuda.Stream(device) if self.is_cuda else None
        self._handle = ctypes.c_void_p(int(self._stream.cuda_stream)) if self._stream is not None else None
        # One event per (group, unit), recorded again by every load: a step's waits are
        # enqueued before the next step records it again, and two loads of one step record
        # it on the same stream, in order.
        self._events: dict[tuple[int, int], torch.cuda.Event] = {}
        self._memcpy_2d = find_cuda_memcpy_2d(loaded_cudart()) if self.is_cuda else None
        self.issued: dict[str, int] = {}
        """Group loads planned per path: ``dma`` (2-D copies of runs) or ``kernel`` (gather)."""

    def new_step(self) -> LayerLoads:
        return LayerLoads(self)

    def load(self, groups: Sequence[GroupLoad], into: LayerLoads,
             timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None) -> None:
        """Plan every group's copies and hand them to ``into`` (CUDA: the first layers are
        issued now, layer 0 of every group first). Bad input raises before anything is
        issued. ``timing`` (CUDA) is recorded around the step's copies."""
        plans = [GroupPlan(g, self._memcpy_2d, self.halving) for g in groups if len(g.block_ids)]
        for p in plans:
            path = "dma" if p.dma else "kernel"
            self.issued[path] = self.issued.get(path, 0) + 1
        into.add(plans, timing)

    def start(self, timing: tuple[torch.cuda.Event, torch.cuda.Event] | None) -> None:
        """Before a load's first copy: order the load stream after the work enqueued so far
        (a step that freed the fresh blocks may still read them; the plan's index uploads)."""
        assert self._stream is not None
        current = torch.cuda.current_stream(self.device)
        if timing is None:
            self._stream.wait_stream(current)
            return
        # One event for both: the copies' start is where the load stream may go on.
        timing[0].record(current)
        self._stream.wait_event(timing[0])

    def issue(self, plan: GroupPlan, a: int, b: int) -> torch.cuda.Event:
        """Enqueue layers ``[a, b)`` of the plan; returns the event recorded after them. On the
        host's critical path: no stream context or new event for DMA copies."""
        st = self._stream
        assert st is not None
        if plan.dma:
            plan.copy_layers(a, b, self._memcpy_2d, self._handle)
        else:
            with torch.cuda.stream(st):
                plan.copy_layers(a, b)
        key = (plan.load.group_idx, a)
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = torch.cuda.Event()
        ev.record(st)
        return ev

    def join(self, timing: tuple[torch.cuda.Event, torch.cuda.Event] | None) -> torch.cuda.Event:
        """An event after everything issued on the load stream."""
        assert self._stream is not None
        if timing is not None:
            timing[1].record(self._stream)
            return timing[1]
        return self._stream.record_event()
