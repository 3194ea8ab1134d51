"""The decoder and loader against Hugging Face transformers on the same random checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.model.checkpoint import TinyModelSpec, write_tiny_model
from engine.model.config import ModelConfigError, load_model_config
from engine.model.llama import DenseCausalAttention
from engine.model.loader import load_model

LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _reference(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits


def _dense(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model = load_model(model_dir)
    b, s = ids.shape
    with torch.no_grad():
        hidden = model(ids.flatten(), torch.arange(s).repeat(b), DenseCausalAttention(b))
        return model.compute_logits(hidden).view(b, s, -1)


@pytest.mark.parametrize(
    "spec",
    [
        TinyModelSpec(),
        TinyModelSpec(tie_word_embeddings=True, num_shards=2, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
        TinyModelSpec(rope_scaling={"rope_type": "linear", "factor": 2.0}, seed=3),
    ],
    ids=["plain", "tied-sharded-llama3rope", "linear-rope"],
)
def test_dense_forward_matches_transformers(tmp_path: Path, spec: TinyModelSpec) -> None:
    write_tiny_model(tmp_path, spec)
    ids = torch.randint(0, spec.vocab_size, (2, 80), generator=torch.Generator().manual_seed(0))
    ref = _reference(tmp_path, ids)
    torch.testing.assert_close(_dense(tmp_path, ids), ref, atol=1e-4, rtol=1e-4)


def test_hybrid_config_gives_two_layer_kinds(hybrid_model: Path) -> None:
    cfg = load_model_config(hybrid_model)
    assert cfg.layer_types == ("full_attention", "sliding_attention") * 2
    assert cfg.sliding_window == 32
    assert cfg.qkv_bias is True
    assert cfg.is_hybrid


def test_missing_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"config\.json: not found"):
        load_model_config(tmp_path)


def test_unsupported_model_type_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelConfigError, match="model_type 'gpt2' is not supported"):
        load_model_config(tmp_path)


def test_checkpoint_missing_weights_is_refused(tmp_path: Path) -> None:
    write_tiny_model(tmp_path, TinyModelSpec())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 5
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=r"missing \['model\.layers\.4\."):
        load_model(tmp_path)


def test_sliding_window_changes_the_reference(hybrid_model: Path, tmp_path: Path) -> None:
    """Guards the hybrid comparisons: with the window off, transformers' logits beyond the
    window differ, so agreeing with the windowed reference really checks the window."""
    import shutil

    full = tmp_path / "full"
    shutil.copytree(hybrid_model, full)
    cfg = json.loads((full / "config.json").read_text())
    cfg["use_sliding_window"] = False
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    (full / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1))
    windowed, unwindowed = _reference(hybrid_model, ids), _reference(full, ids)
    torch.testing.assert_close(windowed[:, :32], unwindowed[:, :32], atol=1e-5, rtol=1e-5)
    assert (windowed[:, 40:] - unwindowed[:, 40:]).abs().max() > 1e-2
    torch.testing.assert_close(_dense(full, ids), unwindowed, atol=1e-4, rtol=1e-4)


def test_fused_projections_alias_the_checkpoint_weights(plain_model: Path) -> None:
    """The loader fuses q/k/v and gate/up into one matrix each; the named parameters are views
    of it (no second copy) and still hold exactly the checkpoint's tensors."""
    from safetensors.torch import load_file

    model = load_model(plain_model)
    state = {}
    for f in sorted(plain_model.glob("*.safetensors")):
        state.update(load_file(str(f)))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv is not None and mlp.gate_up is not None
    fused, _ = attn.qkv
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert attn.v_proj.weight.data_ptr() == fused[-attn.v_proj.weight.shape[0]:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up[mlp.gate_proj.weight.shape[0]:].data_ptr()
    for name, value in model.state_dict().items():
        if name in state:
            assert torch.equal(value, state[name]), name
