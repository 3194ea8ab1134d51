"""Tiny random-weight checkpoints (plain Llama and hybrid Qwen2), built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model.checkpoint import TinyModelSpec, write_tiny_model

BLOCK = 16
WINDOW = 32


@pytest.fixture(scope="session")
def plain_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("plain"), TinyModelSpec())


@pytest.fixture(scope="session")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("hybrid"), TinyModelSpec(hybrid=True, sliding_window=WINDOW))
