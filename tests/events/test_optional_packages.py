"""A model directory that needs a package the install lacks (jinja2 for a chat template,
tokenizers for tokenizer.json) is one clear error naming the package, not an ImportError."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from events.prompt import PromptError, load_chat_template
from events.tokenizer import TokenizerError, load_tokenizer


def test_a_chat_template_without_jinja2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    monkeypatch.setitem(sys.modules, "jinja2", None)  # as if not installed
    with pytest.raises(PromptError, match="pip install jinja2"):
        load_chat_template(tmp_path)


def test_a_tokenizer_json_without_tokenizers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(TokenizerError, match="pip install tokenizers"):
        load_tokenizer(tmp_path)
    assert load_tokenizer(tmp_path / "elsewhere").kind == "bytes"  # no tokenizer.json: no package needed
