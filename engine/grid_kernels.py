"""Attention of a grid step (engine.step_graphs) as Triton kernels reading the paged cache.

The eager grid attention gathers each row's blocks, permutes them to one K/V matrix per KV
head, and runs two batched GEMMs with a float32 softmax and a mask between: ~8 kernels and two
copies of the keys per layer. Here each program takes one row, one KV head and one slice of
the row's keys (sliced so that the GPU is full even for one row), reads the K/V tiles straight
from the cache through the row's block ids, applies the grid's mask (the prologue's ``hidden``,
True = hidden) and keeps an online softmax in float32; a second small kernel merges the
slices. The probabilities enter the second product in the KV dtype, as flash attention does.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor

from engine.model.fused import triton

BLOCK_N = 64


def usable(q: Tensor, cache_tensor: Tensor) -> bool:
    """CUDA with Triton, a float dtype, a head dim that is a power of two >= 16, a block size
    that divides the key tile."""
    d, bs = q.shape[-1], cache_tensor.shape[3]
    return (triton is not None and q.is_cuda and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and d >= 16 and d & (d - 1) == 0 and BLOCK_N % bs == 0 and q.stride(-1) == 1 and q.stride(1) == d)


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _partial_kernel(q_ptr, cache_ptr, gather_ptr, hidden_ptr, acc_ptr, ml_ptr, stride_qt, scale,
                        NB, LAYERS, LI, NKEYS, SPLITS, KEYS_PER_SPLIT: tl.constexpr,
                        Q: tl.constexpr, REP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                        M: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr):
        rh = tl.program_id(0)
        split = tl.program_id(1)
        r = rh // HKV
        h = rh % HKV
        m = tl.arange(0, M)
        m_ok = m < REP * Q
        qslot = m % Q
        head = h * REP + m // Q
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (r * Q + qslot)[:, None].to(tl.int64) * stride_qt + head[:, None] * D + d[None, :],
                    mask=m_ok[:, None], other=0.0)
        m_i = tl.full((M,), float("-inf"), tl.float32)
        l_i = tl.zeros((M,), tl.float32)
        acc = tl.zeros((M, D), tl.float32)
        lo = split * KEYS_PER_SPLIT
        hi = tl.minimum(lo + KEYS_PER_SPLIT, NKEYS)
        for i in range(0, KEYS_PER_SPLIT, BLOCK):
            key = lo + i + tl.arange(0, BLOCK)
            k_ok = key < hi
            blk = tl.load(gather_ptr + r * NB + key // BS, mask=k_ok, other=0).to(tl.int64)
            # (block, layer, K, token) row of the cache, head h; V is BS * HKV * D further.
            row = ((blk * LAYERS + LI) * 2 * BS + key % BS) * (HKV * D) + h * D
            kptr = cache_ptr + row[:, None] + d[None, :]
            k = tl.load(kptr, mask=k_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            hid = tl.load(hidden_ptr + (r * Q + qslot)[:, None] * NKEYS + key[None, :],
                          mask=m_ok[:, None] & k_ok[None, :], other=1)
            s = tl.where(hid != 0, float("-inf"), s * scale)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(kptr + BS * HKV * D, mask=k_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        out = (rh * SPLITS + split).to(tl.int64)
        tl.store(acc_ptr + out * M * D + m[:, None] * D + d[None, :], acc)
        tl.store(ml_ptr + out * 2 * M + m, m_i)
        tl.store(ml_ptr + out * 2 * M + M + m, l_i)

    @triton.jit
    def _merge_kernel(acc_ptr, ml_ptr, out_ptr, stride_ot, SPLITS: tl.constexpr,
                      Q: tl.constexpr, REP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, M: tl.constexpr):
        rh = tl.program_id(0)
        r = rh // HKV
        h = rh % HKV
        m = tl.arange(0, M)
        d = tl.arange(0, D)
        first = rh.to(tl.int64) * SPLITS
        top = tl.full((M,), float("-inf"), tl.float32)
        for s in range(SPLITS):
            top = tl.maximum(top, tl.load(ml_ptr + (first + s) * 2 * M + m))
        top = tl.where(top == float("-inf"), 0.0, top)
        num = tl.zeros((M, D), tl.float32)
        den = tl.zeros((M,), tl.float32)
        for s in range(SPLITS):
            w = tl.exp(tl.load(ml_ptr + (first + s) * 2 * M + m) - top)
            den += w * tl.load(ml_ptr + (first + s) * 2 * M + M + m)
            num += w[:, None] * tl.load(acc_ptr + (first + s) * M * D + m[:, None] * D + d[None, :])
        m_ok = m < REP * Q
        row = (r * Q + m % Q).to(tl.int64)
        head = h * REP + m // Q
        o = num / tl.where(m_ok, den, 1.0)[:, None]
        tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * D + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])


@cache
def _num_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def grid_attention(q: Tensor, cache_tensor: Tensor, li: int, gather: Tensor, hidden: Tensor,
                   rows: int, queries: int) -> Tensor:
    """``[R * Q, Hq, D]`` attention of the grid's queries ``q`` over layer ``li`` of the cache:
    row r reads the blocks ``gather[r * NB : (r + 1) * NB]``; ``hidden`` ``[R, 1, Q, K]`` is True
    where a query may not see a key."""
    hq, d = q.shape[1], q.shape[2]
    hkv, bs, layers = cache_tensor.shape[4], cache_tensor.shape[3], cache_tensor.shape[1]
    rep = hq // hkv
    nb = gather.numel() // rows
    nkeys = nb * bs
    m = max(16, 1 << (rep * queries - 1).bit_length())
    tiles = -(-nkeys // BLOCK_N)
    want = -(-2 * _num_sms(q.device.index or 0) // (rows * hkv))
    per_split = -(-tiles // max(1, min(tiles, want))) * BLOCK_N
    splits = -(-nkeys // per_split)
    acc = torch.empty((rows * hkv * splits, m, d), dtype=torch.float32, device=q.device)
    ml = torch.empty((rows * hkv * splits, 2, m), dtype=torch.float32, device=q.device)
    out = torch.empty((rows * queries, hq, d), dtype=q.dtype, device=q.device)
    # float32 (CPU-parity tests): exact products, not TF32; half types: the default.
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    _partial_kernel[(rows * hkv, splits)](q, cache_tensor, gather, hidden.view(torch.uint8), acc, ml, q.stride(0),
                                          d**-0.5, nb, layers, li, nkeys, splits, KEYS_PER_SPLIT=per_split, Q=queries, REP=rep,
                                          HKV=hkv, D=d, BS=bs, M=m, BLOCK=BLOCK_N, PREC=prec)
    _merge_kernel[(rows * hkv,)](acc, ml, out, out.stride(0), SPLITS=splits, Q=queries, REP=rep, HKV=hkv, D=d, M=m)
    return out
