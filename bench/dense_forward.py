"""The yardstick for the engine's cold prefill: a minimal dense PyTorch forward of the same
weights, written as plainly as PyTorch allows and sharing no code with the engine's model.

One prompt from position 0, no KV cache, no scheduler, no hashing: embedding, per layer
``F.rms_norm`` (torch's fused kernel), the q/k/v GEMM, rope (``x * cos + rotate_half(x) * sin``),
``scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` (flash / cuDNN on an H200),
the output projection and residual, ``F.rms_norm``, the gate/up GEMM, ``silu(gate) * up``, the
down projection and residual; the final norm and the LM head on the last token only, and that
token's argmax brought to the host, as a TTFT ends. ``bare=True`` leaves out the norms and rope
(the "bare forward" of issue 22).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.model.llama import LlamaForCausalLM


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.inference_mode()
def dense_forward(model: LlamaForCausalLM, ids: Tensor, bare: bool = False) -> int:
    """The greedy next token after ``ids`` (``[T]`` on the model's device)."""
    cfg = model.config
    t, hq, hkv, hd, d = ids.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    body = model.model
    x = F.embedding(ids, body.embed_tokens.weight)
    freqs = torch.arange(t, device=ids.device, dtype=torch.float32)[:, None] * model.inv_freq[None, :]  # type: ignore[index]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        h = x if bare else F.rms_norm(x, (d,), layer.input_layernorm.weight, cfg.rms_norm_eps)
        qkv = F.linear(h, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
                       if attn.qkv is None else attn.qkv[0], None if attn.qkv is None else attn.qkv[1])
        q, k, v = qkv.split([hq * hd, hkv * hd, hkv * hd], dim=-1)
        q, k, v = q.view(t, hq, hd), k.view(t, hkv, hd), v.view(t, hkv, hd)
        if not bare:
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True, enable_gqa=True)
        x = x + F.linear(o[0].transpose(0, 1).reshape(t, hq * hd), attn.o_proj.weight)
        h = x if bare else F.rms_norm(x, (d,), layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        gate_up = F.linear(h, mlp.gate_up if mlp.gate_up is not None
                           else torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        gate, up = gate_up.chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, mlp.down_proj.weight)
    last = x[-1:] if bare else F.rms_norm(x[-1:], (d,), body.norm.weight, cfg.rms_norm_eps)
    return int(F.linear(last, model.lm_head.weight).float().argmax().item())


def time_dense(model: LlamaForCausalLM, prompt_len: int, reps: int, seed: int = 0) -> dict[str, Any]:
    """Median wall ms of the dense forward and of the bare one over a prompt of ``prompt_len``
    random tokens (each after two warm-ups), the two interleaved."""
    dev = model.lm_head.weight.device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=gen).to(dev)
    times: dict[str, list[float]] = {"dense_ms": [], "bare_ms": []}
    for _ in range(2):
        dense_forward(model, ids)
        dense_forward(model, ids, bare=True)
    for _ in range(reps):
        for name, bare in (("dense_ms", False), ("bare_ms", True)):
            t0 = time.perf_counter()
            dense_forward(model, ids, bare)  # ends on the host: .item() waits for the GPU
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}
