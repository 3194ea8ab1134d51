"""Cold prefills replayed as CUDA graphs: one request from position 0, padded to a bucket.

An eager prefill launches ~17 kernels a layer from Python; on an H200 that host work (5-13 ms
for the 1B shape, by machine) exceeded the GPU's own time below ~4k tokens, so a 1k-token cold
prefill cost twice its kernels. A step that computes one request from position 0 with no
earlier context (every group attends densely, no load in flight) instead replays a graph
captured for its bucket of tokens: the prompt is padded with token 0 up to the bucket, the
padding's K/V writes go to the null block, and causal attention keeps the padding out of every
real token's result. Buckets round up to a sixteenth of the next power of two (at most ~6%
padding), at least ``min_tokens``; the least recently used graph is dropped past ``max_graphs``.
Graphs share one memory pool (they replay one at a time, and the step reads its logits before
the next replay).

Inputs live in one static device buffer per bucket (ids, block table, the real token count),
filled by one copy from pinned memory before each replay.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

from engine.kv_cache import KVCacheGroup
from engine.model.llama import LlamaForCausalLM
from engine.runner import GroupStep, PagedAttention
from engine.step_graphs import record, warm_up
from engine.step_inputs import write_rows


def bucket(n: int, min_tokens: int) -> int:
    """Tokens of the graph that runs an ``n``-token prefill."""
    n = max(n, min_tokens)
    step = max(16, (1 << (n - 1).bit_length()) // 16)
    return -(-n // step) * step


class _Bucket:
    def __init__(self, tokens: int, width: list[int], device: torch.device) -> None:
        self.tokens, self.width = tokens, width
        self.host = torch.zeros(tokens + sum(width) + 1, dtype=torch.long, pin_memory=True)
        self.static = torch.zeros_like(self.host, device=device)
        self.copied: torch.cuda.Event | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Tensor | None = None


class PrefillGraphs:
    def __init__(self, model: LlamaForCausalLM, groups: list[KVCacheGroup], layer_slots: dict[int, tuple[int, int]],
                 device: torch.device, min_tokens: int, max_graphs: int = 16) -> None:
        self.model, self.groups, self.layer_slots, self.device = model, groups, layer_slots, device
        self.min_tokens, self.max_graphs = min_tokens, max_graphs
        self.block_size = groups[0].block_size
        self._buckets: OrderedDict[int, _Bucket] = OrderedDict()
        self._pool: tuple[int, int] | None = None
        self.steps = self.captures = 0

    def run(self, token_ids: Sequence[int], tables: Sequence[Sequence[int]]) -> Tensor:
        """float32 logits ``[1, vocab]`` of the last of ``token_ids`` (positions 0..n-1), whose
        K/V are written through ``tables`` (per group: the request's block table)."""
        n = len(token_ids)
        tokens = bucket(n, self.min_tokens)
        b = self._buckets.get(tokens)
        if b is None:
            width = [-(-tokens // self.block_size) for _ in self.groups]
            b = self._buckets[tokens] = _Bucket(tokens, width, self.device)
            if len(self._buckets) > self.max_graphs:
                self._buckets.popitem(last=False)
        self._buckets.move_to_end(tokens)
        if b.copied is not None:
            b.copied.synchronize()  # the last replay's copy has read the pinned buffer
        values = list(token_ids) + [0] * (tokens - n)
        for table, w in zip(tables, b.width, strict=True):
            values += list(table[:w]) + [0] * (w - min(len(table), w))
        values.append(n)
        b.host.copy_(torch.tensor(values, dtype=torch.long))
        b.static.copy_(b.host, non_blocking=True)
        b.copied = torch.cuda.Event()
        b.copied.record()
        self.steps += 1
        if b.graph is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            warm_up(lambda: self._forward(b), self.device)
            b.graph, b.out = record(lambda: self._forward(b), self._pool)
            self.captures += 1
        b.graph.replay()
        assert b.out is not None
        return b.out

    def _forward(self, b: _Bucket) -> Tensor:
        dev, bs, t = self.device, self.block_size, b.tokens
        ids, n = b.static[:t], b.static[-1:]
        positions = torch.arange(t, device=dev)
        real = positions < n
        steps, off = [], t
        for group, w in zip(self.groups, b.width, strict=True):
            table = b.static[off : off + w]
            off += w
            block = torch.where(real, table[positions // bs], 0)  # padding writes to the null block
            steps.append(GroupStep(write_rows(block, positions, int(group.tensor.shape[1]), bs), [(0, t)], None))
        hidden = self.model(ids, positions, PagedAttention(self.groups, self.layer_slots, steps))
        return self.model.compute_logits(hidden.index_select(0, n - 1)).float()
