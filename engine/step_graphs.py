"""Small steps as padded grids over the paged cache, replayed as CUDA graphs.

A step whose requests each compute only a few tokens (decodes, the last block of a prefix or
CPU-tier hit, short chunks) costs far more in host work than on the GPU: ~45 eager kernel
launches per layer from Python. Such a step is laid out as a fixed grid instead, ``R`` request
rows of ``Q`` query slots, each reading ``NB`` whole blocks per KV group, all rounded up to
powers of two, so that one captured CUDA graph per grid shape replays it with a single launch.

Everything a graph reads lives in one static buffer per shape, rewritten by the host each step
(on CUDA pinned memory that the graph reads itself at its start: no copy is queued): token
ids, each row's first position and token count, the flat index of its last token, and per
group the row's first visible key position and its block ids. Write
rows and masks are derived from those inside the graph. Padding (query slots past a row's
tokens, rows past the step's requests) writes its K/V into the null block (never read unmasked:
the null block holds finite values only) and attends to one key so softmax stays finite; its
outputs are dropped.

Capture is lazy, per shape, on the step's own inputs: the warm-up passes write the same K/V
to the same rows as the replay will, so they change nothing. The least recently used shape is
dropped past ``max_graphs``. ``capture=False`` runs the same grid eagerly (CPU tests of the
layout; the CUDA tests check capture and replay against it).

A step whose KV is still being loaded layer by layer (engine.offload.layerwise) is given
``wait(layer)``; its shape then replays as segments, one graph for the inputs and embedding,
one per layer, one for the logits, in the same graph pool, with ``wait(layer)`` on the stream
before each layer's segment: the layers already loaded compute while the next ones load.

The shape's static buffers are engine.grid_buffers.GridInputs; the grid's attention is
engine.grid_attention.GridAttention.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from engine import grid_inputs
from engine.grid_attention import GridAttention
from engine.grid_buffers import GridInputs, GridRow, GridShape
from engine.kv_cache import KVCacheGroup, first_visible_block
from engine.model.llama import LlamaForCausalLM


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass
class _Entry:
    """One shape's static inputs and its graphs: whole (one launch), and per-layer segments."""

    inputs: GridInputs
    whole: tuple[torch.cuda.CUDAGraph, Tensor] | None = None
    segments: tuple[list[torch.cuda.CUDAGraph], Tensor] | None = None


class StepGraphs:
    """Runs eligible steps as grids; on CUDA through one captured graph per grid shape."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        groups: list[KVCacheGroup],
        layer_slots: dict[int, tuple[int, int]],
        device: torch.device,
        capture: bool = True,
        max_tokens: int = 512,
        max_graphs: int = 32,
        max_key_bytes: int = 1 << 30,
    ) -> None:
        self.model, self.groups, self.layer_slots, self.device = model, groups, layer_slots, device
        self.capture = capture and device.type == "cuda"
        self.max_tokens, self.max_graphs, self.max_key_bytes = max_tokens, max_graphs, max_key_bytes
        self.block_size = groups[0].block_size
        cfg = model.config
        self._heads, self._kv_bytes_per_key = cfg.num_heads, 2 * cfg.num_kv_heads * cfg.head_dim * 4
        # At least 64 keys per row, and a multiple of 64 (aligned GEMM shapes): every bucket
        # is a power of two or a multiple of 64 blocks, so a power-of-two minimum keeps it so.
        self._min_blocks = 64 // math.gcd(64, self.block_size)
        self._entries: OrderedDict[GridShape, _Entry] = OrderedDict()
        self._pool: Any = None  # torch.cuda graph pool handle, shared by every graph
        self.steps = 0  # steps run as grids (replayed or eager)
        self.captures = 0

    def shape_for(self, rows: Sequence[GridRow]) -> GridShape | None:
        """The grid that holds these requests, or None when the step is too large for one."""
        if not rows:
            return None
        r = _pow2(len(rows))
        q = _pow2(max(len(x.token_ids) for x in rows))
        if r * q > self.max_tokens:
            return None
        bs = self.block_size
        blocks = []
        for group in self.groups:
            window = group.spec.sliding_window
            nb = max(-(-(x.start + len(x.token_ids)) // bs) - first_visible_block(x.start, window, bs) for x in rows)
            nb = max(self._min_blocks, _blocks_bucket(nb))
            # Transient per layer: float32 scores [R, Hq, Q, K] and the gathered K and V
            # (counted at 4 bytes an element, an upper bound).
            if r * nb * bs * (self._heads * q * 4 + self._kv_bytes_per_key) > self.max_key_bytes:
                return None
            blocks.append(nb)
        return GridShape(r, q, tuple(blocks))

    def run(self, shape: GridShape, rows: Sequence[GridRow], wait: Callable[[int], None] | None = None,
            ids: Tensor | None = None, settled: bool = False) -> Tensor:
        """float32 logits ``[shape.rows, vocab]``: row i is rows[i]'s last token (padding after).
        ``wait(layer)`` is called (on the stream, in layer order) before each layer runs.
        ``ids``: a device tensor holding row i's one token (``shape.queries`` must be 1), in
        place of the rows' own ``token_ids``: the tokens of a step still running.
        ``settled``: every step launched before this one has completed (``GridInputs.upload``)."""
        assert ids is None or (shape.queries == 1 and ids.numel() == len(rows))
        values = self._values(shape, rows)
        self.steps += 1
        entry = self._entries.get(shape)
        if entry is None:
            entry = self._entries[shape] = _Entry(GridInputs(shape, self.device))
            if len(self._entries) > self.max_graphs:
                self._entries.popitem(last=False)
        self._entries.move_to_end(shape)
        entry.inputs.upload(values, ids, settled)
        try:
            return self._launch(shape, entry, wait)
        finally:
            entry.inputs.launched()

    def _launch(self, shape: GridShape, entry: _Entry, wait: Callable[[int], None] | None) -> Tensor:
        """Launch the step whose inputs are uploaded (capturing its graphs the first time)."""
        if not self.capture:
            return self._forward(shape, entry.inputs, wait)
        if wait is None:
            if entry.whole is None:
                entry.whole = self._capture(shape, entry.inputs)
            graph, out = entry.whole
            graph.replay()
            return out
        if entry.segments is None:
            entry.segments = self._capture_segments(shape, entry.inputs, wait)
        graphs, out = entry.segments
        graphs[0].replay()
        for layer, graph in enumerate(graphs[1:-1]):
            wait(layer)
            graph.replay()
        graphs[-1].replay()
        return out

    def _warm_up(self, shape: GridShape, inputs: GridInputs, wait: Callable[[int], None] | None) -> None:
        """Two eager passes on a side stream: lazy cuBLAS/kernel initialisation must not happen
        during capture. They write the same K/V as the replay will, so they change nothing."""
        warm_up(lambda: self._forward(shape, inputs, wait), self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()

    def _graph(self, fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        return record(fn, self._pool)

    def _capture(self, shape: GridShape, inputs: GridInputs) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        self._warm_up(shape, inputs, None)
        graph, out = self._graph(lambda: self._forward(shape, inputs))
        self.captures += 1
        return graph, out

    def _capture_segments(
        self, shape: GridShape, inputs: GridInputs, wait: Callable[[int], None]
    ) -> tuple[list[torch.cuda.CUDAGraph], Tensor]:
        """Segments share the pool and always replay in capture order, so one may reuse memory
        freed by an earlier one; what flows between them (hidden states, masks, rows) stays
        referenced here."""
        self._warm_up(shape, inputs, wait)
        graphs = []
        graph, (x, cos, sin, attn, ends) = self._graph(lambda: self._prologue(shape, inputs))
        graphs.append(graph)
        pending = None
        for layer in self.model.model.layers:
            graph, (x, pending) = self._graph(partial(layer, x, cos, sin, attn, pending))
            graphs.append(graph)
        graph, out = self._graph(lambda: self._epilogue(x, pending, ends))
        graphs.append(graph)
        self.captures += 1
        return graphs, out

    def _values(self, shape: GridShape, rows: Sequence[GridRow]) -> list[int]:
        r, q, bs = shape.rows, shape.queries, self.block_size
        pad = r - len(rows)
        ids: list[int] = []
        for x in rows:
            ids.extend(x.token_ids)
            ids.extend([0] * (q - len(x.token_ids)))
        ids.extend([0] * (pad * q))
        starts = [x.start for x in rows] + [0] * pad
        counts = [len(x.token_ids) for x in rows] + [0] * pad
        ends = [i * q + len(x.token_ids) - 1 for i, x in enumerate(rows)] + [0] * pad
        values = ids + starts + counts + ends
        for g, group in enumerate(self.groups):
            nb = shape.blocks[g]
            window = group.spec.sliding_window
            firsts = [first_visible_block(x.start, window, bs) for x in rows]
            values += [f * bs for f in firsts] + [0] * pad
            for x, f in zip(rows, firsts, strict=True):
                table = x.tables[group.spec.group_idx][f : f + nb]
                values += table
                values += [0] * (nb - len(table))
            values += [0] * (pad * nb)
        return values

    def _forward(self, shape: GridShape, inputs: GridInputs, wait: Callable[[int], None] | None = None) -> Tensor:
        x, cos, sin, attn, ends = self._prologue(shape, inputs)
        pending = None
        for i, layer in enumerate(self.model.model.layers):
            if wait is not None:
                wait(i)
            x, pending = layer(x, cos, sin, attn, pending)
        return self._epilogue(x, pending, ends)

    def _epilogue(self, x: Tensor, pending: Tensor | None, ends: Tensor) -> Tensor:
        hidden = self.model.final_norm(x, pending)
        return self.model.compute_logits(hidden[ends]).float()

    def _prologue(self, shape: GridShape, inputs: GridInputs) -> tuple[Tensor, Tensor, Tensor, GridAttention, Tensor]:
        """Masks, write rows and block gathers from the static inputs; embeddings and rope."""
        q, bs = shape.queries, self.block_size
        flat = inputs.flat()
        dev = flat.device
        ids, start, count = (inputs.part(flat, n) for n in ("ids", "start", "count"))
        q_pos = start[:, None] + torch.arange(q, device=dev)[None, :]  # [R, Q]
        rows, gathers, hidden = [], [], []
        for g, group in enumerate(self.groups):
            nb, layers = shape.blocks[g], int(group.tensor.shape[1])
            lo, gather = inputs.part(flat, f"lo{g}"), inputs.part(flat, f"gather{g}")
            window = group.spec.sliding_window
            row, hid = grid_inputs.rows_and_mask(start, count, lo, gather, q, nb, bs, layers, window)
            rows.append(row)
            hidden.append(hid)
            gathers.append(gather)
        attn = GridAttention(self.groups, self.layer_slots, shape, rows, gathers, hidden)
        x, cos, sin = self.model.embed(ids, q_pos.reshape(-1))
        return x, cos, sin, attn, inputs.part(flat, "ends")


def warm_up(fn: Callable[[], Any], device: torch.device) -> None:
    """Two eager runs on a side stream: lazy cuBLAS/kernel initialisation must not happen
    during capture (the runs must write what the replay will write, so they change nothing)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)


def record(fn: Callable[[], Any], pool: Any) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn`` captured as a graph in ``pool``, and what it returned (its output tensors)."""
    graph = torch.cuda.CUDAGraph()
    # thread_local: the offload connector's worker thread keeps issuing its own copies,
    # event queries and host registrations meanwhile; in the default (global) mode any of
    # them would invalidate this capture (found by the e2e GPU offload test).
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


def _blocks_bucket(n: int) -> int:
    """Blocks per row, rounded up: to a power of two up to 64, then to a multiple of 64 (few
    shapes to capture, and never 2x the keys to read for a long context)."""
    return _pow2(n) if n <= 64 else -(-n // 64) * 64
