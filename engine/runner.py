"""Model runner: turns a scheduled step into one batched forward over the paged KV cache.

Tokens of every scheduled request are flattened into one batch. Attention per group writes the
new K/V into their slots, gathers each request's visible K/V from its blocks into a padded
``[B, K]`` view and runs ``scaled_dot_product_attention`` with a causal (and window) mask. A
single request starting at position 0 with no window takes the dense ``is_causal`` path, which
can use flash kernels on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.kv_cache import KVCacheGroup
from engine.kv_manager import KVCacheManager
from engine.model.llama import LlamaForCausalLM
from engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class GroupStep:
    """Per-group attention inputs of one step (tensors on the model's device).

    Requests that start at position 0 and fit the window attend densely (``is_causal`` on their
    own span, flash-capable); the others read their context from the paged cache."""

    write_blocks: Tensor  # [T] block id of each new token's slot
    write_offsets: Tensor  # [T]
    dense_spans: list[tuple[int, int]]  # [lo, hi) token spans of fresh requests
    paged: PagedInputs | None


@dataclass(frozen=True)
class PagedInputs:
    tokens: Tensor  # [Tp] flat indices (into the step's tokens) of the paged requests
    q_index: Tensor  # [Tp] their positions in the padded [B * max_q] query grid
    batch: int
    max_q: int
    gather_blocks: Tensor  # [B, K]
    gather_offsets: Tensor  # [B, K]
    mask: Tensor  # [B, 1, max_q, K] bool, True = may attend


class PagedAttention:
    """AttentionBackend over the paged cache for one step."""

    def __init__(self, groups: list[KVCacheGroup], layer_slots: dict[int, tuple[int, int]], steps: list[GroupStep]) -> None:
        self.groups, self.layer_slots, self.steps = groups, layer_slots, steps

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        g, li = self.layer_slots[layer_idx]
        cache = self.groups[g].tensor
        st = self.steps[g]
        cache[st.write_blocks, li, 0, st.write_offsets] = k
        cache[st.write_blocks, li, 1, st.write_offsets] = v
        if st.paged is None and len(st.dense_spans) == 1:
            return _causal(q, k, v)
        out = torch.empty_like(q)
        for lo, hi in st.dense_spans:
            out[lo:hi] = _causal(q[lo:hi], k[lo:hi], v[lo:hi])
        if st.paged is not None:
            out[st.paged.tokens] = _paged(cache, li, q[st.paged.tokens], st.paged)
        return out


def _causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def _paged(cache: Tensor, li: int, q: Tensor, p: PagedInputs) -> Tensor:
    keys = cache[p.gather_blocks, li, 0, p.gather_offsets].transpose(1, 2)
    values = cache[p.gather_blocks, li, 1, p.gather_offsets].transpose(1, 2)
    qp = q.new_zeros(p.batch * p.max_q, *q.shape[1:])
    qp[p.q_index] = q
    qp = qp.view(p.batch, p.max_q, *q.shape[1:]).transpose(1, 2)
    if q.is_cuda:
        # Masked GQA runs only on the math kernel; expanded heads let the memory-efficient one
        # run. cuDNN is left out: it builds a new plan for every key length, i.e. every step.
        rep = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=p.mask)
    else:
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=p.mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(p.batch * p.max_q, *q.shape[1:])[p.q_index]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        groups: list[KVCacheGroup],
        layer_slots: dict[int, tuple[int, int]],
        kv: KVCacheManager,
        device: torch.device,
    ) -> None:
        self.model, self.groups, self.layer_slots, self.kv, self.device = model, groups, layer_slots, kv, device
        self.block_size = kv.block_size

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, sample_rows: list[int]) -> Tensor:
        """Run the step; return float32 logits for the scheduled entries in ``sample_rows``."""
        sched = out.scheduled
        bs = self.block_size
        starts = [s.start for s in sched]
        lens = [s.num_new_tokens for s in sched]
        batch = len(sched)
        positions = torch.cat([torch.arange(st, st + n) for st, n in zip(starts, lens, strict=True)])
        input_ids = torch.tensor(
            [t for s in sched for t in s.request.all_token_ids[s.start : s.start + s.num_new_tokens]],
            dtype=torch.long,
        )
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        row = torch.repeat_interleave(torch.arange(batch), torch.tensor(lens))
        steps: list[GroupStep] = []
        for group in self.groups:
            tables = [self.kv.block_table(s.request.request_id)[group.spec.group_idx] for s in sched]
            width = max(len(t) for t in tables)
            bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
            write_blocks = self._dev(bt[row, positions // bs])
            write_offsets = self._dev(positions % bs)
            window = group.spec.sliding_window
            fresh = [st == 0 and (window is None or n <= window) for st, n in zip(starts, lens, strict=True)]
            spans = [(offsets[i], offsets[i + 1]) for i in range(batch) if fresh[i]]
            rest = [i for i in range(batch) if not fresh[i]]
            paged = self._paged_inputs(bt[rest], [starts[i] for i in rest], [lens[i] for i in rest],
                                       [offsets[i] for i in rest], window) if rest else None
            steps.append(GroupStep(write_blocks, write_offsets, spans, paged))
        attn = PagedAttention(self.groups, self.layer_slots, steps)
        hidden = self.model(self._dev(input_ids), self._dev(positions), attn)
        ends = torch.tensor([offsets[i + 1] - 1 for i in sample_rows], dtype=torch.long)
        return self.model.compute_logits(hidden[self._dev(ends)]).float()

    def _dev(self, x: Tensor) -> Tensor:
        """Host -> device without stalling on the queued kernels (pinned + non-blocking on CUDA)."""
        if self.device.type != "cuda":
            return x
        return x.pin_memory().to(self.device, non_blocking=True)

    def _paged_inputs(
        self, bt: Tensor, starts: list[int], lens: list[int], token_offsets: list[int], window: int | None
    ) -> PagedInputs:
        bs = self.block_size
        batch, max_q = len(starts), max(lens)
        tokens = torch.cat([torch.arange(o, o + n) for o, n in zip(token_offsets, lens, strict=True)])
        q_index = torch.cat([torch.arange(n) + i * max_q for i, n in enumerate(lens)])
        # Keys visible to this step: [lo, start + n) per request; lo skips what the window hides.
        los = [0 if window is None else max(0, st - window + 1) // bs * bs for st in starts]
        his = [st + n for st, n in zip(starts, lens, strict=True)]
        # Key width rounded up to 64: aligned for the memory-efficient kernel, and few shapes.
        width = -(-max(h - lo for lo, h in zip(los, his, strict=True)) // 64) * 64
        lo_t, hi_t = torch.tensor(los)[:, None], torch.tensor(his)[:, None]
        kv_pos = lo_t + torch.arange(width)[None, :]
        kv_valid = kv_pos < hi_t
        kv_pos = torch.where(kv_valid, kv_pos, lo_t)
        gather_blocks = torch.gather(bt, 1, kv_pos // bs)
        q_pos = torch.tensor(starts)[:, None] + torch.arange(max_q)[None, :]
        q_valid = torch.arange(max_q)[None, :] < torch.tensor(lens)[:, None]
        mask = kv_valid[:, None, :] & (kv_pos[:, None, :] <= q_pos[:, :, None])
        if window is not None:
            mask &= kv_pos[:, None, :] > q_pos[:, :, None] - window
        # Padding query rows attend to one key so softmax stays finite; their output is dropped.
        mask |= (~q_valid)[:, :, None] & (torch.arange(width) == 0)[None, None, :]
        return PagedInputs(
            self._dev(tokens), self._dev(q_index), batch, max_q, self._dev(gather_blocks),
            self._dev(kv_pos % bs), self._dev(mask[:, None]),
        )
