"""Tokenizers, the one rule an engine and a router share: ``tokenizer.json`` of the model
directory through the ``tokenizers`` library (no special tokens added), else one id per UTF-8 byte.

The engine encodes prompts with it and a router hashes the same ids (events.hashing), so both
must load it here. ``tokenizers`` is imported only when the model directory has a tokenizer.json.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from events.errors import EventsError


class TokenizerError(EventsError, ValueError):
    """A model directory's tokenizer.json that cannot be loaded; the message says why."""


class Tokenizer(Protocol):
    """Text <-> token ids. ``decode`` drops ids that have no text (specials, out of range)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def kind(self) -> str:
        """Which rule encodes: ``"bytes"`` or ``"tokenizer.json"``."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255); higher ids are specials with no text."""

    vocab_size = 256
    kind = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library (no special tokens added)."""

    kind = "tokenizer.json"

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizerImpl
        except ImportError as exc:
            raise TokenizerError(f"{path} needs the tokenizers package: pip install tokenizers") from exc
        try:
            self._tok = HFTokenizerImpl.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for unreadable or foreign JSON
            raise TokenizerError(f"{path} is not a tokenizer the tokenizers library can load: {exc}") from exc

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))


def load_tokenizer(model_dir: str | Path | None) -> Tokenizer:
    """The model directory's tokenizer.json, else bytes (also when no directory is given)."""
    if model_dir:
        path = Path(model_dir) / "tokenizer.json"
        if path.is_file():
            return HFTokenizer(path)
    return ByteTokenizer()
