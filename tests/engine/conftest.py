"""Tiny random-weight checkpoints (plain Llama and hybrid Qwen2), built once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.model.checkpoint import TinyModelSpec, write_tiny_model

BLOCK = 16
WINDOW = 32


@pytest.fixture(scope="session")
def plain_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("plain"), TinyModelSpec())


@pytest.fixture(scope="session")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("hybrid"), TinyModelSpec(hybrid=True, sliding_window=WINDOW))


@pytest.fixture(scope="module", params=["plain", "hybrid"])
def model_and_hf(request: pytest.FixtureRequest) -> tuple[Path, Any]:
    """Each tiny model with its transformers twin (float32, eval)."""
    from transformers import AutoModelForCausalLM

    path: Path = request.getfixturevalue(f"{request.param}_model")
    return path, AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
