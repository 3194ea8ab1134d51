"""Fused elementwise kernels for CUDA (Triton): RMSNorm (with the residual add before it),
SwiGLU's ``silu(gate) * up`` and rope (optionally writing the rotated K and the V of each
token into the paged cache as it goes: one launch instead of three for a grid step).

Each kernel computes its eager formula in llama.py with the same roundings (float32 inside,
rounded to the activation dtype wherever the eager ops round), in one pass over memory instead
of three to five kernels, several of them strided. A 4096-token prefill of the 1B shape spent
~8 ms of its ~21 ms of GPU time in those eager kernels on an H200.

``available(x)`` says whether a tensor can take them: CUDA, Triton importable (it is not on
the CPU machines, which run the eager formulas), a float dtype and a contiguous last dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the model runs its eager formulas
    triton = None  # type: ignore[assignment]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available(x: Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dtype in _DTYPES and x.stride(-1) == 1


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, h_ptr, w_ptr, res_ptr, out_ptr, n,
                         stride_x, stride_h, stride_res, stride_out, eps,
                         HAS_H: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        dt = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_H:  # the residual add, rounded as the eager add rounds, kept for the next layer
            h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
            s = (x + h).to(dt)
            tl.store(res_ptr + row * stride_res + cols, s, mask=mask)
            x = s.to(tl.float32)
        var = tl.sum(x * x, axis=0) / n
        y = (x / tl.sqrt(var + eps)).to(dt).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (w * y).to(dt), mask=mask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, n, stride_gu, stride_out,
                         BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        dt = out_ptr.dtype.element_ty
        g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + n + cols, mask=mask, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (a * u).to(dt), mask=mask)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_x, stride_cos, stride_out,
                     v_ptr, k_rows_ptr, v_rows_ptr, cache_ptr, stride_v, stride_c, first_k, kv_heads,
                     D: tl.constexpr, BLOCK_H: tl.constexpr, STORE: tl.constexpr, BLOCK_KV: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, D)[None, :]
        mask = h < heads
        dt = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + t * stride_x + h * D + d, mask=mask, other=0.0).to(tl.float32)
        swapped = tl.load(x_ptr + t * stride_x + h * D + (d + D // 2) % D, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t * stride_cos + d).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_cos + d).to(tl.float32)
        a = (x * c).to(dt).to(tl.float32)
        b = (swapped * s).to(dt).to(tl.float32)
        y = (a + b).to(dt)
        if STORE:  # heads from first_k on are K: to the token's K row of the cache; V to its V row
            is_k = h >= first_k
            k_row = tl.load(k_rows_ptr + t)
            tl.store(cache_ptr + k_row * stride_c + (h - first_k) * D + d, y, mask=mask & is_k)
            tl.store(out_ptr + t * stride_out + h * D + d, y, mask=mask & (h < first_k))
            if tl.program_id(1) == 0:
                vh = tl.arange(0, BLOCK_KV)[:, None]
                v_ok = vh < kv_heads
                val = tl.load(v_ptr + t * stride_v + vh * D + d, mask=v_ok, other=0.0)
                v_row = tl.load(v_rows_ptr + t)
                tl.store(cache_ptr + v_row * stride_c + vh * D + d, val, mask=v_ok)
        else:
            tl.store(out_ptr + t * stride_out + h * D + d, y, mask=mask)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual_in: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(s, weight * rms_norm(s))`` with ``s = x + residual_in`` (or ``x``), rows of ``[T, d]``."""
    t, n = x.shape
    out = torch.empty_like(x)
    res = torch.empty_like(x) if residual_in is not None else x
    h = residual_in if residual_in is not None else x
    if t:
        _rms_norm_kernel[(t,)](x, h, weight, res, out, n, x.stride(0), h.stride(0), res.stride(0), out.stride(0),
                               eps, HAS_H=residual_in is not None, BLOCK=_next_pow2(n), num_warps=8 if n >= 4096 else 4)
    return res, out


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` of ``[T, 2n]`` (gate first) -> ``[T, n]``."""
    t, n2 = gate_up.shape
    n = n2 // 2
    out = gate_up.new_empty((t, n))
    block = min(1024, _next_pow2(n))
    if t:
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out


def rope_usable(x: Tensor) -> bool:
    """``[T, H, D]`` with heads adjacent (as a slice of the fused qkv is) and D a power of two."""
    d = x.shape[-1]
    return available(x) and x.stride(1) == d and d == _next_pow2(d) and d >= 2


def rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """``x * cos + swap_halves(x) * signed_sin`` of ``[T, H, D]`` -> contiguous ``[T, H, D]``."""
    return _rope(x, cos, signed_sin, x.shape[1], None)


def rope_store(qk: Tensor, cos: Tensor, signed_sin: Tensor, num_q: int, v: Tensor, cache: Tensor, k_rows: Tensor,
               v_rows: Tensor) -> Tensor:
    """Rope of ``qk`` (``[T, Hq + Hkv, D]``, queries first) in one kernel that also writes the
    rotated keys and ``v`` (``[T, Hkv, D]``) to the cache: token t's K to row ``k_rows[t]`` and
    V to ``v_rows[t]`` of ``cache`` (``[rows, Hkv, D]``, the model's dtype). Returns the
    rotated queries ``[T, Hq, D]`` (contiguous)."""
    d = qk.shape[-1]
    assert cache.dtype == qk.dtype and cache.shape[1:] == v.shape[1:] and v.stride(-1) == 1 and v.stride(1) == d
    return _rope(qk, cos, signed_sin, num_q, (v, cache, k_rows, v_rows))


def _rope(x: Tensor, cos: Tensor, signed_sin: Tensor, out_heads: int,
          store: tuple[Tensor, Tensor, Tensor, Tensor] | None) -> Tensor:
    t, heads, d = x.shape
    out = x.new_empty((t, out_heads, d))
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
    block_h = max(1, min(_next_pow2(heads), 4096 // d))
    v, cache, k_rows, v_rows = store if store is not None else (x, x, x, x)  # unused pointers without a store
    kv_heads = v.shape[1] if store is not None else 1
    if t:
        _rope_kernel[(t, triton.cdiv(heads, block_h))](
            x, cos, signed_sin, out, heads, x.stride(0), cos.stride(0), out.stride(0),
            v, k_rows, v_rows, cache, v.stride(0), cache.stride(0), out_heads, kv_heads,
            D=d, BLOCK_H=block_h, STORE=store is not None, BLOCK_KV=_next_pow2(kv_heads))
    return out
