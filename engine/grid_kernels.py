"""Attention of a grid step (engine.step_graphs) as Triton kernels reading the paged cache.

The eager grid attention gathers each row's blocks, permutes them to one K/V matrix per KV
head, and runs two batched GEMMs with a float32 softmax and a mask between: ~8 kernels and two
copies of the keys per layer. Here each program takes one row, one KV head and one slice of
the row's keys (sliced so that the GPU is full even for one row), reads the K/V tiles straight
from the cache through the row's block ids, applies the grid's mask (the prologue's ``hidden``,
True = hidden) and keeps an online softmax in float32; a second small kernel merges the
slices, one program per query head, all slices loaded at once. Where a row is one slice (a
row of one key tile, or enough rows to fill the GPU without slicing) its program writes the
normalised output itself and no merge is launched. The probabilities enter the second
product in the KV dtype, as flash attention does.
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
    def _partial_kernel(q_ptr, cache_ptr, gather_ptr, hidden_ptr, acc_ptr, ml_ptr, out_ptr, stride_qt, stride_ot,
                        scale, NB, LAYERS, LI, NKEYS, SPLITS, KEYS_PER_SPLIT: tl.constexpr,
                        Q: tl.constexpr, REP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                        M: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr, DIRECT: tl.constexpr):
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
            v = tl.load(kptr + BS * HKV * D, mask=k_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            hid = tl.load(hidden_ptr + (r * Q + qslot)[:, None] * NKEYS + key[None, :],
                          mask=m_ok[:, None] & k_ok[None, :], other=1)
            s = tl.where(hid != 0, float("-inf"), s * scale)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        if DIRECT:  # the row's only slice: the normalised output, as the merge would write it
            o = acc / tl.where(m_ok, l_i, 1.0)[:, None]
            orow = (r * Q + qslot).to(tl.int64)
            tl.store(out_ptr + orow[:, None] * stride_ot + head[:, None] * D + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
        else:  # only the real query heads' rows: the merge reads no padding
            out = (rh * SPLITS + split).to(tl.int64)
            tl.store(acc_ptr + out * M * D + m[:, None] * D + d[None, :], acc, mask=m_ok[:, None])
            tl.store(ml_ptr + out * 2 * M + m, m_i, mask=m_ok)
            tl.store(ml_ptr + out * 2 * M + M + m, l_i, mask=m_ok)

    @triton.jit
    def _merge_kernel(acc_ptr, ml_ptr, out_ptr, stride_ot, SPLITS, Q: tl.constexpr, REP: tl.constexpr,
                      HKV: tl.constexpr, D: tl.constexpr, M: tl.constexpr, SP: tl.constexpr):
        """One (row, KV head, query head x slot): every slice's (max, sum, accumulator) in one load."""
        rh = tl.program_id(0)
        mi = tl.program_id(1)
        s = tl.arange(0, SP)
        s_ok = s < SPLITS
        part = rh.to(tl.int64) * SPLITS + s
        mx = tl.load(ml_ptr + part * 2 * M + mi, mask=s_ok, other=float("-inf"))
        den = tl.load(ml_ptr + part * 2 * M + M + mi, mask=s_ok, other=0.0)
        top = tl.max(mx, axis=0)
        w = tl.exp(mx - tl.where(top == float("-inf"), 0.0, top))
        d = tl.arange(0, D)
        acc = tl.load(acc_ptr + (part * M + mi)[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
        o = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * den, axis=0)
        row = ((rh // HKV) * Q + mi % Q).to(tl.int64)
        head = (rh % HKV) * REP + mi // Q
        tl.store(out_ptr + row * stride_ot + head * D + d, o.to(out_ptr.dtype.element_ty))


@cache
def _num_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def grid_attention(q: Tensor, cache_tensor: Tensor, li: int, gather: Tensor, hidden: Tensor,
                   rows: int, queries: int, split: tuple[int, int] | None = None) -> Tensor:
    """``[R * Q, Hq, D]`` attention of the grid's queries ``q`` over layer ``li`` of the cache:
    row r reads the blocks ``gather[r * NB : (r + 1) * NB]``; ``hidden`` ``[R, 1, Q, K]`` is True
    where a query may not see a key. ``split``: (slices, keys per slice, a multiple of
    ``BLOCK_N``) in place of :func:`key_splits`' choice (bench/bench_grid_attention.py)."""
    hq, d = q.shape[1], q.shape[2]
    hkv, bs, layers = cache_tensor.shape[4], cache_tensor.shape[3], cache_tensor.shape[1]
    rep = hq // hkv
    nb = gather.numel() // rows
    m = max(16, 1 << (rep * queries - 1).bit_length())
    splits, per_split = split or key_splits(nb * bs, rows * hkv, _num_sms(q.device.index or 0))
    out = torch.empty((rows * queries, hq, d), dtype=q.dtype, device=q.device)
    if splits == 1:  # no partials: the kernel writes ``out`` (these two are never touched)
        acc = ml = out
    else:
        acc = torch.empty((rows * hkv * splits, m, d), dtype=torch.float32, device=q.device)
        ml = torch.empty((rows * hkv * splits, 2, m), dtype=torch.float32, device=q.device)
    # float32 (CPU-parity tests): exact products, not TF32; half types: the default.
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    _partial_kernel[(rows * hkv, splits)](q, cache_tensor, gather, hidden.view(torch.uint8), acc, ml, out, q.stride(0),
                                          out.stride(0), d**-0.5, nb, layers, li, nb * bs, splits,
                                          KEYS_PER_SPLIT=per_split, Q=queries, REP=rep, HKV=hkv, D=d, BS=bs, M=m,
                                          BLOCK=BLOCK_N, PREC=prec, DIRECT=splits == 1)
    if splits > 1:
        _merge_kernel[(rows * hkv, rep * queries)](acc, ml, out, out.stride(0), splits, Q=queries, REP=rep, HKV=hkv,
                                                   D=d, M=m, SP=1 << (splits - 1).bit_length())
    return out


def key_splits(nkeys: int, programs: int, sms: int) -> tuple[int, int]:
    """(slices, keys per slice) of each row's ``nkeys`` keys, with ``programs`` (rows x KV
    heads) per slice: about two programs per SM in all (flash decoding's split). Even a
    256-key row is worth slicing at batch 1: one program reads its tiles one after another
    (6.9 us a layer on an H200) where four slices and the merge take 4.3 us
    (bench/bench_grid_attention.py)."""
    tiles = -(-nkeys // BLOCK_N)
    want = -(-2 * sms // programs)
    per_split = -(-tiles // max(1, min(tiles, want))) * BLOCK_N
    return -(-nkeys // per_split), per_split
