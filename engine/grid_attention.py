"""Attention of one grid step (engine.step_graphs) over the paged cache: each token's K/V
written to its row, whole blocks read per row, masked; by the Triton kernels of
engine.grid_kernels where they apply, else by two batched GEMMs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from engine import grid_kernels
from engine.grid_buffers import GridShape
from engine.kv_cache import KVCacheGroup
from engine.model.llama import KVRows


class GridAttention:
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
