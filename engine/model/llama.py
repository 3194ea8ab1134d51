"""A Llama-family decoder over flattened token batches; attention is delegated to a backend.

Parameter names match Hugging Face's (``model.layers.{i}.self_attn.q_proj.weight`` ...) so a
checkpoint loads with ``load_state_dict``. The model never owns KV memory: each attention call
goes through an ``AttentionBackend`` that writes to and reads from whatever cache the caller has
(the paged cache of the runner, or nothing for the dense reference forward).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model import fused
from engine.model.config import ModelConfig


class KVRows(NamedTuple):
    """Where one layer's new K and V go: rows of a flat ``[rows, Hkv, D]`` view of a cache."""

    cache: Tensor
    k_rows: Tensor  # [T] int64, token t's K row
    v_rows: Tensor  # [T] int64, token t's V row


class AttentionBackend(Protocol):
    """Attention for one layer over a flattened batch: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
        """Write k and v to the cache (None: the model wrote them to :meth:`kv_rows`), attend."""
        ...

    def kv_rows(self, layer_idx: int) -> KVRows | None:
        """Rows the model may write this layer's K/V to itself (rope's kernel does, as it
        rotates, then passes ``k = v = None``); None: pass them to the call."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False
        """One Triton kernel (engine.model.fused) where the input can take it."""

    def forward(self, x: Tensor) -> Tensor:
        if self.fused and x.dim() == 2 and fused.available(x):
            return fused.rms_norm(x, self.weight, self.eps)[1]
        # Normalise in float32 like the reference, then scale in the model dtype (one fused
        # kernel for the normalisation where torch has one).
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def add_forward(self, x: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        """``(x + h, self(x + h))``: the residual add and the norm after it, in one kernel."""
        if self.fused and x.dim() == 2 and fused.available(x) and fused.available(h):
            return fused.rms_norm(x, self.weight, self.eps, residual_in=h)
        s = x + h
        return s, self(s)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse frequencies with the config's theta and scaling (default, linear, llama3)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = cfg.rope_scaling.get("rope_type", "default")
    if kind == "linear":
        return inv / float(cfg.rope_scaling["factor"])
    if kind == "llama3":
        s = cfg.rope_scaling
        factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_len = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv


def _rotate(x: Tensor, cos: Tensor, signed_sin: Tensor, use_fused: bool = False) -> Tensor:
    """Rope: ``x * cos + rotate_half(x) * sin``, with ``rotate_half(x) * sin`` as the halves of
    ``x`` swapped times ``signed_sin`` (sin with its first half negated; both halves of sin are
    equal). Negation is exact, so this is bit for bit the reference's result, in one kernel
    fewer (roll, not neg + cat); ``use_fused``: in one Triton kernel where ``x`` can take it."""
    if use_fused and fused.rope_usable(x):
        return fused.rope(x, cos, signed_sin)
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, d, bias=False)
        self.qkv: tuple[Tensor, Tensor | None] | None = None
        """After :func:`fuse_projections`: q, k and v weights (and biases) as one matrix."""
        self.fused = False
        """Rope in one Triton kernel (engine.model.fused) where the input can take it."""

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend) -> Tensor:
        t = x.shape[0]
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        k: Tensor | None
        v: Tensor | None
        if self.qkv is not None:
            qkv = F.linear(x, *self.qkv)
            # Rope on q and k at once (the same elementwise ops on every head, half the kernels).
            qk = qkv[:, : nq + nkv].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            v = qkv[:, nq + nkv :].view(t, self.num_kv_heads, self.head_dim)
            rows = attn.kv_rows(self.layer_idx) if self.fused and fused.rope_usable(qk) else None
            if rows is not None and rows.cache.dtype == qk.dtype:
                # One kernel: rope, and the rotated K and the V written to the backend's cache.
                q, k, v = fused.rope_store(qk, cos, sin, self.num_heads, v, *rows), None, None
            else:
                qk = _rotate(qk, cos, sin, self.fused)
                q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
            k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
            q = _rotate(q, cos, sin)
            k = _rotate(k, cos, sin)
        out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up: Tensor | None = None
        """After :func:`fuse_projections`: gate and up weights as one matrix."""
        self.fused = False
        """``silu(gate) * up`` in one Triton kernel (engine.model.fused) where it can run."""

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up is not None:
            gate_up = F.linear(x, self.gate_up)
            if self.fused and fused.available(gate_up):
                return self.down_proj(fused.silu_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend,
                pending: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(x, mlp_out)``: the residual stream and this layer's MLP output not yet added to it;
        the next layer's norm (or the final one, :meth:`LlamaForCausalLM.final_norm`) adds it
        in its own kernel. ``pending``: the previous layer's MLP output."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_forward(x, pending)
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(h, cos, sin, attn))
        return x, self.mlp(h)


class LlamaBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns final hidden states; ``compute_logits`` projects."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and signed sin (first half negated, see _rotate), ``[T, 1, D]``: computed in
        float32 (as the reference does), cast to the activation dtype."""
        inv_freq: Tensor = self.inv_freq  # type: ignore[assignment]
        freqs = positions.float()[:, None] * inv_freq.float()[None, :]
        sin = freqs.sin()
        return torch.cat((freqs, freqs), dim=-1).cos().to(dtype)[:, None, :], torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :]

    def embed(self, input_ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """What the first layer takes: token embeddings, rope's cos and signed sin."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        return x, cos, sin

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        x, cos, sin = self.embed(input_ids, positions)
        pending = None
        for layer in self.model.layers:
            x, pending = layer(x, cos, sin, attn, pending)
        return self.final_norm(x, pending)

    def final_norm(self, x: Tensor, pending: Tensor | None) -> Tensor:
        """The final norm of ``x + pending`` (the last layer's MLP output, see DecoderLayer)."""
        return self.model.norm(x) if pending is None else self.model.norm.add_forward(x, pending)[1]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)


def fuse_projections(model: LlamaForCausalLM) -> None:
    """One GEMM for q/k/v and one for gate/up per layer (fewer, larger kernels; what vLLM's
    QKVParallelLinear and MergedColumnParallelLinear do). The original parameters become views
    of the fused matrices, so names, ``state_dict`` and memory stay as they were."""
    for module in model.modules():
        if isinstance(module, Attention):
            w, bias = _fuse(module.q_proj, module.k_proj, module.v_proj)
            module.qkv = (w, bias)
        elif isinstance(module, MLP):
            module.gate_up, _ = _fuse(module.gate_proj, module.up_proj)


def enable_fused_kernels(model: LlamaForCausalLM, on: bool = True) -> None:
    """Norms, rope and SwiGLU through engine.model.fused where the tensors can take it (CUDA
    with Triton); elsewhere, and with ``on=False``, the eager formulas run."""
    for module in model.modules():
        if isinstance(module, RMSNorm | Attention | MLP):
            module.fused = on


def _fuse(*linears: nn.Linear) -> tuple[Tensor, Tensor | None]:
    """Concatenate the linears' weights (and biases, if all have one) and make each linear's
    parameters views of the result."""
    w = torch.cat([lin.weight for lin in linears]).detach()
    biases = [lin.bias for lin in linears]
    b = torch.cat([x for x in biases if x is not None]).detach() if all(x is not None for x in biases) else None
    off = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(w[off : off + n], requires_grad=False)
        if b is not None:
            lin.bias = nn.Parameter(b[off : off + n], requires_grad=False)
        off += n
    return w, b


class DenseCausalAttention:
    """Reference backend without a KV cache: ``batch`` sequences of equal length from position 0."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def kv_rows(self, layer_idx: int) -> KVRows | None:
        return None  # no cache

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
        assert k is not None and v is not None
        b = self.batch
        qb = q.view(b, -1, *q.shape[1:]).transpose(1, 2)
        kb = k.view(b, -1, *k.shape[1:]).transpose(1, 2)
        vb = v.view(b, -1, *v.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape)
