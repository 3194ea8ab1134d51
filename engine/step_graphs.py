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

from engine import grid_inputs, grid_kernels
from engine.kv_cache import KVCacheGroup, first_visible_block
from engine.model.llama import KVRows, LlamaForCausalLM
from engine.offload.cuda_runtime import CudaArray


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


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


class _Inputs:
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


@dataclass
class _Entry:
    """One shape's static inputs and its graphs: whole (one launch), and per-layer segments."""

    inputs: _Inputs
    whole: tuple[torch.cuda.CUDAGraph, Tensor] | None = None
    segments: tuple[list[torch.cuda.CUDAGraph], Tensor] | None = None


class _GridAttention:
    """AttentionBackend for one grid step: writes each token's K/V (or lets the model's rope
    kernel write them, ``kv_rows``), reads whole blocks, masks."""

    def __init__(
        self, groups: list[KVCacheGroup], layer_slots: dict[int, tuple[int, int]], shape: GridShape,
        rows: list[Tensor], gathers: list[Tensor], hidden: list[Tensor],
    ) -> None:
        self.layer_slots, self.shape = layer_slots, shape
        self.caches = [g.tensor for g in groups]
        self.flat = [t.view(-1, *t.shape[-2:]) for t in self.caches]
        self.rows, self.gathers, self.hidden = rows, gathers, hidden

    def kv_rows(self, layer_idx: int) -> KVRows:
        g, li = self.layer_slots[layer_idx]
        return KVRows(self.flat[g], self.rows[g][li, 0], self.rows[g][li, 1])

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
        g, li = self.layer_slots[layer_idx]
        if k is not None and v is not None:  # else the model's rope kernel wrote them (kv_rows)
            flat, rows = self.flat[g], self.rows[g]
            flat.index_copy_(0, rows[li, 0], k)
            flat.index_copy_(0, rows[li, 1], v)
        r, nq = self.shape.rows, self.shape.queries
        cache = self.caches[g]
        if grid_kernels.usable(q, cache):
            return grid_kernels.grid_attention(q, cache, li, self.gathers[g], self.hidden[g], r, nq)
        hkv, d = cache.shape[4], cache.shape[5]
        rep = q.shape[1] // hkv
        kv = cache[:, li].index_select(0, self.gathers[g])  # [R * NB, 2, bs, Hkv, D]: K and V at once
        # [2, R * Hkv, K, D] (one copy for K and V), and the queries grouped under their KV head
        # [R * Hkv, rep * Q, D]: no copies of K/V per query head, and two batched GEMMs instead
        # of an attention kernel. With few queries per row the fused kernels parallelise badly
        # (the masked memory-efficient one took 240 us per layer for 16 queries over 4096 keys
        # on an H200). The permuting copy moves each head's D values as 8-byte words: torch's
        # strided copy costs per element (2-byte elements: 30 us per layer at batch 32 on an
        # H200; a gather of single (head, dim) rows instead of whole blocks took 70 us).
        nb = kv.shape[0] // r
        words = kv.view(torch.int64) if (d * kv.element_size()) % 8 == 0 else kv
        kv = words.view(r, nb, 2, -1, hkv, words.shape[-1]).permute(2, 0, 4, 1, 3, 5)
        kv = kv.reshape(2, r * hkv, -1, words.shape[-1]).view(cache.dtype)
        keys, values = kv[0], kv[1]
        scale = d**-0.5
        grouped = q.view(r, nq, hkv, rep, d).permute(0, 2, 3, 1, 4)
        exact = math.frexp(scale)[0] == 0.5  # a power of two: scaling q first is exact
        if exact:  # one kernel that groups and scales
            qg = torch.mul(grouped, scale, out=q.new_empty((r, hkv, rep, nq, d))).view(r * hkv, rep * nq, d)
        else:
            qg = grouped.reshape(r * hkv, rep * nq, d)
        scores = _bmm_f32(qg, keys.transpose(1, 2))
        if not exact:
            scores.mul_(scale)
        scores = scores.view(r, hkv, rep, nq, -1)
        scores.masked_fill_(self.hidden[g][:, :, None], float("-inf"))  # [R, 1, Q, K], True = hidden
        # As flash attention does: float32 scores and softmax, probabilities in the KV dtype
        # for the second GEMM, float32 accumulation rounded once to the KV dtype.
        probs = torch.softmax(scores, dim=-1).to(values.dtype).view(r * hkv, rep * nq, -1)
        out = torch.bmm(probs, values).view(r, hkv, rep, nq, d)
        return out.permute(0, 3, 1, 2, 4).reshape(r * nq, hkv * rep, d).to(q.dtype)


def _bmm_f32(a: Tensor, b: Tensor) -> Tensor:
    """Batched GEMM with a float32 result (half inputs on CUDA: tensor cores, float32 output)."""
    if a.dtype == torch.float32:
        return torch.bmm(a, b)
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


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
        ``settled``: every step launched before this one has completed (``_Inputs.upload``)."""
        assert ids is None or (shape.queries == 1 and ids.numel() == len(rows))
        values = self._values(shape, rows)
        self.steps += 1
        entry = self._entries.get(shape)
        if entry is None:
            entry = self._entries[shape] = _Entry(_Inputs(shape, self.device))
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

    def _warm_up(self, shape: GridShape, inputs: _Inputs, wait: Callable[[int], None] | None) -> None:
        """Two eager passes on a side stream: lazy cuBLAS/kernel initialisation must not happen
        during capture. They write the same K/V as the replay will, so they change nothing."""
        warm_up(lambda: self._forward(shape, inputs, wait), self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()

    def _graph(self, fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        return record(fn, self._pool)

    def _capture(self, shape: GridShape, inputs: _Inputs) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        self._warm_up(shape, inputs, None)
        graph, out = self._graph(lambda: self._forward(shape, inputs))
        self.captures += 1
        return graph, out

    def _capture_segments(
        self, shape: GridShape, inputs: _Inputs, wait: Callable[[int], None]
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

    def _forward(self, shape: GridShape, inputs: _Inputs, wait: Callable[[int], None] | None = None) -> Tensor:
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

    def _prologue(self, shape: GridShape, inputs: _Inputs) -> tuple[Tensor, Tensor, Tensor, _GridAttention, Tensor]:
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
        attn = _GridAttention(self.groups, self.layer_slots, shape, rows, gathers, hidden)
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
