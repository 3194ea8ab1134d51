"""Fixtures for the reliability suite: a namespace per test and one tiny model per session."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from engine.model.checkpoint import TinyModelSpec, write_tiny_model


@pytest.fixture
def namespace() -> str:
    return "r" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("rel-model"), TinyModelSpec())
