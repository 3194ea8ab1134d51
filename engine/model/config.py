"""Model shape read from a Hugging Face ``config.json`` (Llama, Mistral and Qwen2 layouts)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from engine.errors import EngineError

LayerType = Literal["full_attention", "sliding_attention"]
LAYER_TYPES: Final[tuple[LayerType, ...]] = ("full_attention", "sliding_attention")
SUPPORTED_MODEL_TYPES: Final[tuple[str, ...]] = ("llama", "mistral", "qwen2")
ROPE_TYPES: Final[tuple[str, ...]] = ("default", "linear", "llama3")


class ModelConfigError(EngineError, ValueError):
    """config.json is missing, malformed or describes a model this engine cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    """The fields of ``config.json`` the decoder needs, normalised across model families."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    layer_types: tuple[LayerType, ...] = ()
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def is_hybrid(self) -> bool:
        return len(set(self.layer_types)) > 1


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{path}: not found (a model directory needs config.json)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    return parse_model_config(raw)


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    model_type = str(raw.get("model_type", "llama"))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(
            f"model_type {model_type!r} is not supported; choose one of {SUPPORTED_MODEL_TYPES}"
        )
    try:
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_layers = int(raw["num_hidden_layers"])
        vocab = int(raw["vocab_size"])
        inter = int(raw["intermediate_size"])
    except KeyError as exc:
        raise ModelConfigError(f"config.json: missing required field {exc.args[0]!r}") from exc
    num_kv = int(raw.get("num_key_value_heads") or num_heads)
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    if num_heads % num_kv:
        raise ModelConfigError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    theta, scaling = _rope(raw)
    layer_types, window = _layer_types(raw, model_type, num_layers)
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    bos = raw.get("bos_token_id")
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama only when attention_bias is set.
        qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        layer_types=layer_types,
        sliding_window=window,
        eos_token_ids=eos_ids,
        bos_token_id=None if bos is None else int(bos),
    )


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    # transformers >= 5 writes rope_parameters; older checkpoints use rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(f"rope_type {rope_type!r} is not supported; choose one of {ROPE_TYPES}")
    scaling: dict[str, Any] = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = rope_type
    if rope_type == "llama3":
        scaling.setdefault(
            "original_max_position_embeddings",
            raw.get("original_max_position_embeddings", raw.get("max_position_embeddings", 2048)),
        )
    return theta, scaling


def _layer_types(
    raw: dict[str, Any], model_type: str, num_layers: int
) -> tuple[tuple[LayerType, ...], int | None]:
    window = raw.get("sliding_window")
    if model_type == "qwen2" and not raw.get("use_sliding_window", False):
        window = None
    types = raw.get("layer_types")
    if types is None:
        # Mistral applies its window to every layer; Llama has none.
        kind: LayerType = "sliding_attention" if window is not None and model_type != "llama" else "full_attention"
        types = [kind] * num_layers
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ModelConfigError(f"layer_types must list {num_layers} entries from {LAYER_TYPES}, got {types!r}")
    if "sliding_attention" not in types:
        return tuple(types), None
    if window is None or int(window) <= 0:
        raise ModelConfigError("sliding_attention layers need a positive sliding_window")
    return tuple(types), int(window)
