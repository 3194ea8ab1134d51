"""Model runner: turns a scheduled step into one batched forward over the paged KV cache.

Tokens of every scheduled request are flattened into one batch. Attention per group writes the
new K/V into their slots (``index_copy_`` into a flat row view of the cache), then reads each
request's visible K/V through its block table with one ``index_select`` of whole blocks per
layer and K/V, and runs ``scaled_dot_product_attention``:

- a request that starts at position 0 and fits the window attends densely (``is_causal`` on its
  own span, flash-capable);
- a single request with earlier context and no window (a prefix hit, a CPU-tier hit, a decode
  on its own) attends with a lower-right causal bias over exactly its keys: no mask is built
  or copied, and CUDA runs the flash / memory-efficient kernels;
- anything else (batched decodes, windows) uses a padded ``[B, K]`` key grid and a mask.

All of a step's index tensors travel to the device in one pinned copy.

A small step (few tokens per request) goes to :class:`engine.step_graphs.StepGraphs` instead
when the runner has one: a padded grid replayed as a CUDA graph (one launch, not ~45 per layer).
A cold prefill too large for those (one request from position 0, attending densely) replays a
padded prefill graph (:mod:`engine.prefill_graphs`) on CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from engine.grid_buffers import GridRow
from engine.kv_cache import KVCacheGroup, first_visible_block
from engine.kv_connector import LayerWaits
from engine.kv_manager import KVCacheManager
from engine.model.llama import KVRows, LlamaForCausalLM
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.step_graphs import StepGraphs
from engine.step_inputs import StepUpload, token_positions, write_rows

if TYPE_CHECKING:
    from engine.prefill_graphs import PrefillGraphs


@dataclass(frozen=True)
class GroupStep:
    """Per-group attention inputs of one step (tensors on the model's device)."""

    write_rows: Tensor  # [L, 2, T] row of each new token's K (0) and V (1) slot in the flat cache
    dense_spans: list[tuple[int, int]]  # [lo, hi) token spans of fresh requests
    paged: PagedInputs | None


@dataclass(frozen=True)
class PagedInputs:
    tokens: Tensor | None  # [Tp] flat indices of the paged requests' tokens; None: all of them
    gather: Tensor  # [B * nb] block ids whose keys are read, nb per request, from its first visible block
    batch: int
    num_blocks: int  # nb
    num_keys: int  # keys per request row (nb * block_size, or exactly hi in the single-request case)
    max_q: int
    q_index: Tensor | None  # [Tp] positions in the padded [B * max_q] query grid; None: single request
    mask: Tensor | None  # [B, 1, max_q, K] bool, True = may attend; None: lower-right causal


class PagedAttention:
    """AttentionBackend over the paged cache for one step."""

    def __init__(self, groups: list[KVCacheGroup], layer_slots: dict[int, tuple[int, int]], steps: list[GroupStep],
                 wait: Callable[[int], None] | None = None) -> None:
        self.layer_slots, self.steps, self.wait = layer_slots, steps, wait
        self.caches = [g.tensor for g in groups]
        # Row view [blocks * layers * 2 * block_size, heads, dim] for the writes.
        self.flat = [t.view(-1, *t.shape[-2:]) for t in self.caches]

    def kv_rows(self, layer_idx: int) -> KVRows | None:
        return None  # written here, after this layer's loads are waited for

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
        assert k is not None and v is not None
        if self.wait is not None:
            self.wait(layer_idx)  # this layer's loads are in place before it is read or written
        g, li = self.layer_slots[layer_idx]
        st = self.steps[g]
        flat = self.flat[g]
        flat.index_copy_(0, st.write_rows[li, 0], k)
        flat.index_copy_(0, st.write_rows[li, 1], v)
        p = st.paged
        if p is None and len(st.dense_spans) == 1:
            return _causal(q, k, v)
        if p is not None and p.tokens is None:
            return _paged(self.caches[g], li, q, p)
        out = torch.empty_like(q)
        for lo, hi in st.dense_spans:
            out[lo:hi] = _causal(q[lo:hi], k[lo:hi], v[lo:hi])
        if p is not None:
            out[p.tokens] = _paged(self.caches[g], li, q[p.tokens], p)
        return out


def _causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def _read(cache: Tensor, li: int, kv: int, p: PagedInputs) -> Tensor:
    """[B, Hkv, K, D]: the visible keys (kv=0) or values (kv=1), whole blocks read in place order."""
    rows = cache[:, li, kv].index_select(0, p.gather)  # [B * nb, bs, H, D], contiguous
    return rows.view(p.batch, -1, *rows.shape[-2:])[:, : p.num_keys].transpose(1, 2)


def _repeat_heads(x: Tensor, rep: int) -> Tensor:
    if rep == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, rep, n, d).reshape(b, h * rep, n, d)


def _paged(cache: Tensor, li: int, q: Tensor, p: PagedInputs) -> Tensor:
    keys, values = _read(cache, li, 0, p), _read(cache, li, 1, p)
    rep = q.shape[1] // keys.shape[1]
    if p.mask is None:
        # One request: its queries are the last q rows of its keys (lower-right causal).
        qp = q.transpose(0, 1)[None]
        bias = causal_lower_right(q.shape[0], p.num_keys)
        if q.is_cuda:
            # Expanded heads: the flash / memory-efficient kernels take no GQA with this bias.
            out = F.scaled_dot_product_attention(qp, _repeat_heads(keys, rep), _repeat_heads(values, rep), attn_mask=bias)
        else:
            out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=bias, enable_gqa=True)
        return out[0].transpose(0, 1)
    assert p.q_index is not None
    qp = q.new_zeros(p.batch * p.max_q, *q.shape[1:])
    qp[p.q_index] = q
    qp = qp.view(p.batch, p.max_q, *q.shape[1:]).transpose(1, 2)
    if q.is_cuda:
        # Masked GQA runs only on the math kernel; expanded heads let the memory-efficient one
        # run. cuDNN is left out: it builds a new plan for every key length, i.e. every step.
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(qp, _repeat_heads(keys, rep), _repeat_heads(values, rep), attn_mask=p.mask)
    else:
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=p.mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(p.batch * p.max_q, *q.shape[1:])[p.q_index]


def _new_token_ids(s: ScheduledRequest) -> list[int]:
    return s.request.token_ids(s.start, s.start + s.num_new_tokens)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        groups: list[KVCacheGroup],
        layer_slots: dict[int, tuple[int, int]],
        kv: KVCacheManager,
        device: torch.device,
        graphs: StepGraphs | None = None,
    ) -> None:
        self.model, self.groups, self.layer_slots, self.kv, self.device = model, groups, layer_slots, kv, device
        self.graphs = graphs
        self.block_size = kv.block_size
        self._upload = StepUpload(device)
        self.prefill: PrefillGraphs | None = None
        """CUDA graphs for cold prefills, beside the step graphs (too large a step for those)."""
        if graphs is not None:
            from engine.prefill_graphs import PrefillGraphs  # imports this module's attention

            self.prefill = PrefillGraphs(model, groups, layer_slots, device, min_tokens=graphs.max_tokens)
        # Keys per row rounded up to a multiple of 64 (and whole blocks): aligned for the
        # memory-efficient kernel's mask, and few shapes.
        self._blocks_multiple = 64 // math.gcd(64, self.block_size)
        # Model layer -> (group index, layer in the group's tensor), for the per-layer load waits.
        self._layer_groups = {layer: (groups[g].spec.group_idx, li) for layer, (g, li) in layer_slots.items()}

    def _layer_wait(self, waits: LayerWaits | None) -> Callable[[int], None] | None:
        """``wait(layer_idx)`` over model layers, from the connector's per-group waits."""
        if waits is None:
            return None
        where = self._layer_groups
        return lambda layer: waits.wait_layer(*where[layer])

    def _cold(self, sched: list[ScheduledRequest]) -> bool:
        """One request computed from position 0 whose every group attends densely."""
        if len(sched) != 1 or sched[0].start != 0:
            return False
        n = sched[0].num_new_tokens
        return all(g.spec.sliding_window is None or n <= g.spec.sliding_window for g in self.groups)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, sample_rows: list[int], waits: LayerWaits | None = None,
                settled: bool = False) -> Tensor:
        """Run the step; return float32 logits for the scheduled entries in ``sample_rows``.
        ``waits``: loads still in flight; each layer waits for its own before it runs.
        ``settled``: every step launched before has completed (its results were read)."""
        sched = out.scheduled
        wait = self._layer_wait(waits)
        if self.graphs is not None:
            grid = [GridRow(_new_token_ids(s), s.start, self.kv.block_table(s.request.request_id)) for s in sched]
            shape = self.graphs.shape_for(grid)
            if shape is not None:
                logits = self.graphs.run(shape, grid, wait, settled=settled)
                if sample_rows == list(range(len(sample_rows))):
                    return logits[: len(sample_rows)]
                return logits[torch.tensor(sample_rows, device=logits.device)]
        if self.prefill is not None and wait is None and self._cold(sched):
            s = sched[0]
            return self.prefill.run(_new_token_ids(s), self.kv.block_table(s.request.request_id))[: len(sample_rows)]
        return self._execute_eager(sched, sample_rows, wait)

    @torch.inference_mode()
    def execute_decodes(self, sched: list[ScheduledRequest], ids: Tensor) -> Tensor | None:
        """Run one decode token per request as a grid step whose token ids are ``ids`` (a device
        tensor, row i for ``sched[i]``: the tokens of a step still running, not on the host
        yet); float32 logits ``[len(sched), vocab]``, or None (nothing run) when no grid
        holds the step."""
        if self.graphs is None:
            return None
        grid = [GridRow((0,), s.start, self.kv.block_table(s.request.request_id)) for s in sched]
        shape = self.graphs.shape_for(grid)
        if shape is None:
            return None
        return self.graphs.run(shape, grid, None, ids)[: len(sched)]

    def _execute_eager(self, sched: list[ScheduledRequest], sample_rows: list[int],
                       wait: Callable[[int], None] | None) -> Tensor:
        bs = self.block_size
        starts = [s.start for s in sched]
        lens = [s.num_new_tokens for s in sched]
        batch, total = len(sched), sum(lens)
        ids: list[int] = []
        for s in sched:
            ids.extend(_new_token_ids(s))
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        # Only what the host knows goes up (ids, starts and lengths, block tables); positions
        # and each token's cache rows are derived on the device: for a long prefill they are
        # ~100k indices that took milliseconds to build and copy from here.
        up = self._upload
        up.begin()
        i_ids = up.add(torch.tensor(ids, dtype=torch.long))
        i_meta = up.add(torch.tensor(starts + lens, dtype=torch.long))
        i_ends = up.add(torch.tensor([offsets[i + 1] - 1 for i in sample_rows], dtype=torch.long))
        plans: list[tuple[int, list[tuple[int, int]], dict[str, int] | None]] = []
        for group in self.groups:
            tables = [self.kv.block_table(s.request.request_id)[group.spec.group_idx] for s in sched]
            width = max(len(t) for t in tables)
            bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
            i_bt = up.add(bt)
            window = group.spec.sliding_window
            fresh = [st == 0 and (window is None or n <= window) for st, n in zip(starts, lens, strict=True)]
            spans = [(offsets[i], offsets[i + 1]) for i in range(batch) if fresh[i]]
            rest = [i for i in range(batch) if not fresh[i]]
            paged = self._paged_inputs(up, bt[rest], [starts[i] for i in rest], [lens[i] for i in rest],
                                       [offsets[i] for i in rest], window, all_paged=len(rest) == batch) if rest else None
            plans.append((i_bt, spans, paged))
        dev = up.send()
        positions, row = token_positions(dev[i_meta], batch, total)
        steps = [GroupStep(write_rows(dev[i_bt][row, positions // bs], positions, int(g.tensor.shape[1]), bs), spans,
                           self._finish_paged(dev, paged))
                 for g, (i_bt, spans, paged) in zip(self.groups, plans, strict=True)]
        attn = PagedAttention(self.groups, self.layer_slots, steps, wait)
        hidden = self.model(dev[i_ids], positions, attn)
        return self.model.compute_logits(hidden[dev[i_ends]]).float()

    def _paged_inputs(
        self, up: StepUpload, bt: Tensor, starts: list[int], lens: list[int], token_offsets: list[int],
        window: int | None, all_paged: bool,
    ) -> dict[str, int]:
        """Host-side paged inputs, queued on ``up``; returns their indices and sizes."""
        bs = self.block_size
        batch, max_q = len(starts), max(lens)
        # Keys visible to this step: [lo, start + n) per request; lo skips what the window hides.
        los = [first_visible_block(st, window, bs) * bs for st in starts]
        his = [st + n for st, n in zip(starts, lens, strict=True)]
        nb = max(-(-h // bs) - lo // bs for lo, h in zip(los, his, strict=True))
        nb = -(-nb // self._blocks_multiple) * self._blocks_multiple
        first = torch.tensor([lo // bs for lo in los])[:, None] + torch.arange(nb)[None, :]
        # Past the table: the null block (zeros). Masked-out keys past a request's end in its
        # last block read stale slots: finite, as the cache starts zeroed and only ever holds
        # computed or loaded K/V.
        gather = torch.where(first < bt.shape[1], torch.gather(bt, 1, first.clamp(max=bt.shape[1] - 1)), 0)
        info = dict(batch=batch, nb=nb, max_q=max_q, gather=up.add(gather.reshape(-1)))
        info["tokens"] = -1 if all_paged else up.add(
            torch.cat([torch.arange(o, o + n) for o, n in zip(token_offsets, lens, strict=True)]))
        if batch == 1 and window is None:
            info.update(num_keys=his[0], q_index=-1, mask=-1)
            return info
        width = nb * bs
        lo_t, hi_t = torch.tensor(los)[:, None], torch.tensor(his)[:, None]
        kv_pos = lo_t + torch.arange(width)[None, :]
        kv_valid = kv_pos < hi_t
        q_pos = torch.tensor(starts)[:, None] + torch.arange(max_q)[None, :]
        q_valid = torch.arange(max_q)[None, :] < torch.tensor(lens)[:, None]
        mask = kv_valid[:, None, :] & (kv_pos[:, None, :] <= q_pos[:, :, None])
        if window is not None:
            mask &= kv_pos[:, None, :] > q_pos[:, :, None] - window
        # Padding query rows attend to one key so softmax stays finite; their output is dropped.
        mask |= (~q_valid)[:, :, None] & (torch.arange(width) == 0)[None, None, :]
        info.update(num_keys=width, q_index=up.add(torch.cat([torch.arange(n) + i * max_q for i, n in enumerate(lens)])),
                    mask=up.add(mask[:, None]))
        return info

    @staticmethod
    def _finish_paged(dev: list[Tensor], info: dict[str, int] | None) -> PagedInputs | None:
        if info is None:
            return None

        def get(key: str) -> Tensor | None:
            return None if info[key] < 0 else dev[info[key]]

        gather = dev[info["gather"]]
        return PagedInputs(get("tokens"), gather, info["batch"], info["nb"], info["num_keys"], info["max_q"],
                           get("q_index"), get("mask"))
