"""Writes tiny random-weight checkpoints in the Hugging Face format, for tests and demos.

Plain models use the Llama layout; hybrid ones the Qwen2 layout with ``layer_types`` alternating
full and sliding-window attention (Qwen2 is the transformers model that honours per-layer types).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.model.config import parse_model_config
from engine.model.llama import LlamaForCausalLM

BYTE_EOS_TOKEN_ID = 256  # the first id above the byte range: a special with no text


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a random checkpoint; the defaults are the test model."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    hybrid: bool = False
    sliding_window: int = 32
    tie_word_embeddings: bool = False
    num_shards: int = 1
    seed: int = 0
    init_std: float = 0.1
    rope_scaling: dict[str, Any] | None = None
    save_dtype: str = "float32"
    """float32, bfloat16 or float16: the dtype of the saved tensors."""


def tiny_config(spec: TinyModelSpec) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling:
        rope = {**spec.rope_scaling, "rope_theta": spec.rope_theta}
    cfg: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if spec.hybrid else "LlamaForCausalLM"],
        "model_type": "qwen2" if spec.hybrid else "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.hidden_size // spec.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_parameters": rope,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "eos_token_id": BYTE_EOS_TOKEN_ID,
        "bos_token_id": None,
        "torch_dtype": spec.save_dtype,
    }
    if spec.hybrid:
        cfg["use_sliding_window"] = True
        cfg["sliding_window"] = spec.sliding_window
        cfg["max_window_layers"] = spec.num_layers
        cfg["layer_types"] = [
            "full_attention" if i % 2 == 0 else "sliding_attention" for i in range(spec.num_layers)
        ]
    return cfg


def write_tiny_model(model_dir: str | Path, spec: TinyModelSpec) -> Path:
    """Write config.json and random weights (``num_shards`` safetensors files) to ``model_dir``."""
    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = tiny_config(spec)
    with torch.device("meta"):  # shapes only: a 1B-shaped model is not initialised twice
        model = LlamaForCausalLM(parse_model_config(raw))
    save_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec.save_dtype]
    gen = torch.Generator().manual_seed(spec.seed)
    state: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            continue
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
        else:
            value = spec.init_std * torch.randn(param.shape, generator=gen)
        state[name] = value.to(save_dtype).contiguous()
    names = sorted(state)
    shards = [names[i :: spec.num_shards] for i in range(spec.num_shards)]
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if spec.num_shards == 1 else f"model-{i + 1:05d}-of-{spec.num_shards:05d}.safetensors"
        save_file({n: state[n] for n in shard}, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    if spec.num_shards > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    return out
