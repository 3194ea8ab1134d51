"""Tokenizers: ``tokenizer.json`` through the ``tokenizers`` library, else one id per byte."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as HFTokenizerImpl


class Tokenizer(Protocol):
    """Text <-> token ids. ``decode`` drops ids that have no text (specials, out of range)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255); higher ids are specials with no text."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library (no special tokens added)."""

    def __init__(self, path: str | Path) -> None:
        self._tok = HFTokenizerImpl.from_file(str(path))

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        return HFTokenizer(path)
    return ByteTokenizer()
