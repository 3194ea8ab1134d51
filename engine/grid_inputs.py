"""A grid step's write rows and attention mask, derived on the device from its inputs.

``rows_and_mask`` computes them with torch ops (~20 small kernels a step, each of them a
launch inside the step's graph); on CUDA with Triton one kernel computes the same integers
(one program per query slot), the step's fixed cost that a decode at batch 1 pays in full.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.model.fused import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _inputs_kernel(start_ptr, count_ptr, lo_ptr, gather_ptr, rows_ptr, hidden_ptr, NB, LAYERS, RQ, WINDOW,
                       NKEYS: tl.constexpr, Q: tl.constexpr, BS: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_L: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        """One query slot of ``formula`` (its formulas, in its order)."""
        i = tl.program_id(0)
        r = i // Q
        slot = i % Q
        pos = tl.load(start_ptr + r) + slot
        valid = slot < tl.load(count_ptr + r)
        lo = tl.load(lo_ptr + r)
        index = tl.minimum(tl.maximum((pos - lo) // BS, 0), NB - 1)
        block = tl.load(gather_ptr + r * NB + index, mask=valid, other=0)
        base = block * (LAYERS * 2 * BS) + pos % BS
        lk = tl.arange(0, BLOCK_L)  # (layer, K or V) pairs, in the order of rows [L, 2, R * Q]
        tl.store(rows_ptr + lk.to(tl.int64) * RQ + i, base + (lk // 2) * (2 * BS) + (lk % 2) * BS,
                 mask=lk < LAYERS * 2)
        for k0 in range(0, NKEYS, BLOCK_K):
            key = k0 + tl.arange(0, BLOCK_K)
            kv_pos = lo + key
            allowed = kv_pos <= pos
            if HAS_WINDOW:
                allowed = allowed & (kv_pos > pos - WINDOW)
            seen = tl.where(valid, allowed, key == 0)
            tl.store(hidden_ptr + i.to(tl.int64) * NKEYS + key, tl.where(seen, 0, 1).to(tl.uint8), mask=key < NKEYS)


def rows_and_mask(start: Tensor, count: Tensor, lo: Tensor, gather: Tensor, q: int, nb: int, bs: int, layers: int,
                  window: int | None) -> tuple[Tensor, Tensor]:
    """One group's write rows ``[L, 2, R * Q]`` (each query slot's K (0) and V (1) row in the
    flat cache, the null block's for padding) and the keys each query may not see, ``[R, 1,
    Q, K]`` (True = hidden; a padding slot sees key 0 only), from the grid's int64 inputs: each
    row's first position, token count, first visible key and ``nb`` block ids."""
    if triton is not None and start.is_cuda:
        return _kernel(start, count, lo, gather, q, nb, bs, layers, window)
    return formula(start, count, lo, gather, q, nb, bs, layers, window)


def formula(start: Tensor, count: Tensor, lo: Tensor, gather: Tensor, q: int, nb: int, bs: int, layers: int,
            window: int | None) -> tuple[Tensor, Tensor]:
    """rows_and_mask with torch ops (CPU; the reference of the kernel)."""
    r, dev = start.shape[0], start.device
    slot = torch.arange(q, device=dev)
    q_pos = start[:, None] + slot[None, :]  # [R, Q]
    q_valid = slot[None, :] < count[:, None]
    index = ((q_pos - lo[:, None]) // bs).clamp(0, nb - 1)
    block = torch.where(q_valid, gather.view(r, nb).gather(1, index), 0)
    base = (block * (layers * 2 * bs) + q_pos % bs).view(1, 1, -1)
    per_layer = (torch.arange(layers, device=dev) * (2 * bs)).view(-1, 1, 1)
    kv = (torch.arange(2, device=dev) * bs).view(1, 2, 1)  # no host tensors: capturable
    keys = torch.arange(nb * bs, device=dev)
    kv_pos = lo[:, None, None] + keys[None, None, :]  # [R, 1, K]
    allowed = kv_pos <= q_pos[:, :, None]
    if window is not None:
        allowed &= kv_pos > q_pos[:, :, None] - window
    # Inverted once here, not per layer.
    return base + per_layer + kv, ~torch.where(q_valid[:, :, None], allowed, keys == 0)[:, None]


def _kernel(start: Tensor, count: Tensor, lo: Tensor, gather: Tensor, q: int, nb: int, bs: int, layers: int,
            window: int | None) -> tuple[Tensor, Tensor]:
    r = start.shape[0]
    rows = torch.empty((layers, 2, r * q), dtype=torch.long, device=start.device)
    hidden = torch.empty((r, 1, q, nb * bs), dtype=torch.bool, device=start.device)
    _inputs_kernel[(r * q,)](start, count, lo, gather, rows, hidden.view(torch.uint8), nb, layers, r * q,
                             window or 0, NKEYS=nb * bs, Q=q, BS=bs, HAS_WINDOW=window is not None,
                             BLOCK_L=1 << (2 * layers - 1).bit_length(), BLOCK_K=min(1024, 1 << (nb * bs - 1).bit_length()))
    return rows, hidden
