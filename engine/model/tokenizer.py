"""Tokenizers: the rule lives in events.tokenizer (the router encodes with it too)."""

from events.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]
