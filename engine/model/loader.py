"""Loads a Hugging Face model directory (config.json + one or more *.safetensors) into the decoder."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.model.config import ModelConfig, ModelConfigError, load_model_config
from engine.model.llama import (
    LlamaForCausalLM,
    enable_fused_kernels,
    fuse_projections,
    rope_inv_freq,
)


def load_model(
    model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> LlamaForCausalLM:
    """Build the decoder and load its weights; every parameter must come from the checkpoint."""
    cfg = load_model_config(model_dir)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"{model_dir}: no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f), device=str(device)))
    state = {k: v.to(dtype) for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    # Build on the meta device so a 1B-shaped model is not randomly initialised only to be overwritten.
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = set(model.state_dict().keys())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
        state.pop("lm_head.weight", None)
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing or unexpected:
        raise ModelConfigError(
            f"{model_dir}: checkpoint does not match config.json: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)
    fuse_projections(model)
    enable_fused_kernels(model)  # CUDA with Triton; the eager formulas elsewhere
    return model.eval()


def model_config(model_dir: str | Path) -> ModelConfig:
    return load_model_config(model_dir)
