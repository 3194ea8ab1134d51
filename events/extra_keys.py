"""What a request mixes into its blocks' hashes besides the tokens: vLLM's extra keys.

vLLM builds one tuple of extra keys per block (``generate_block_hash_extra_keys`` in
vllm/v1/core/kv_cache_utils.py) from, in this order: the LoRA adapter (every block), each
multimodal item overlapping the block (with the item's offset relative to the block's first
token, so negative when it began in an earlier block), and the cache salt (the first block
only); a block with none of them hashes with ``None``. vLLM 0.33 tags each key with its kind
(``("lora", name, path)``, ``("mm", identifier, offset)``, ``("cache_salt", salt)``) so that a
LoRA name can never collide with a salt; older versions mix in the bare values (``name``,
``(identifier, offset)``, ``salt``). Both forms are here (``form``). Prompt-embedding keys
are not: they hash the request's embedding tensor, which no router holds.

Our own older form, one fixed tuple on every block (``kvctl hash --extra-key``), is
``RequestKeys(fixed=(...))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

KeyForm = Literal["tagged", "untagged"]
KEY_FORMS: Final[tuple[KeyForm, ...]] = ("tagged", "untagged")


@dataclass(frozen=True)
class MultiModalItem:
    """One multimodal input of a prompt: its content hash and the tokens it spans."""

    identifier: str
    offset: int
    """Position of the item's first placeholder token in the prompt."""
    length: int

    def __post_init__(self) -> None:
        if not self.identifier:
            raise ValueError("a multimodal item needs an identifier")
        if self.offset < 0 or self.length < 1:
            raise ValueError(
                f"multimodal item {self.identifier!r}: offset must be >= 0 and length >= 1, "
                f"got offset {self.offset}, length {self.length}"
            )


@dataclass(frozen=True)
class RequestKeys:
    """The extra keys of one request, turned into each block's tuple by :meth:`for_block`."""

    lora_name: str | None = None
    lora_path: str | None = None
    """vLLM 0.33 hashes the adapter's path with its name (tagged form only)."""
    cache_salt: str | None = None
    mm_items: tuple[MultiModalItem, ...] = ()
    """Sorted by offset, not overlapping (vLLM assumes the same)."""
    form: KeyForm = "tagged"
    fixed: tuple[Any, ...] | None = None
    """Our older form: this tuple on every block; excludes every other field."""

    def __post_init__(self) -> None:
        if self.form not in KEY_FORMS:
            raise ValueError(f"key form must be one of {KEY_FORMS}, got {self.form!r}")
        vllm_keys = self.lora_name or self.lora_path or self.cache_salt or self.mm_items
        if self.fixed is not None and vllm_keys:
            raise ValueError("fixed extra keys exclude the LoRA, cache salt and multimodal keys")
        if self.lora_path and not self.lora_name:
            raise ValueError("a LoRA path needs a LoRA name")
        if self.lora_name and self.form == "tagged" and not self.lora_path:
            raise ValueError(
                "vLLM's tagged form hashes ('lora', name, path): give the adapter's path too "
                "(or use the untagged form of older vLLM versions)"
            )
        for before, after in zip(self.mm_items, self.mm_items[1:], strict=False):
            if after.offset < before.offset + before.length:
                raise ValueError(
                    f"multimodal items must be sorted and not overlap: {after.identifier!r} at "
                    f"{after.offset} starts before {before.identifier!r} "
                    f"({before.offset}+{before.length}) ends"
                )

    @property
    def is_empty(self) -> bool:
        return self.fixed is None and not (self.lora_name or self.cache_salt or self.mm_items)

    def for_block(self, start: int, end: int) -> tuple[Any, ...] | None:
        """The extra keys of the block of tokens ``[start, end)``; None when it has none."""
        if self.fixed is not None:
            return self.fixed
        tagged = self.form == "tagged"
        keys: list[Any] = []
        if self.lora_name:
            keys.append(("lora", self.lora_name, self.lora_path) if tagged else self.lora_name)
        for item in self.mm_items:
            if item.offset < end and start < item.offset + item.length:
                rel = item.offset - start
                keys.append(("mm", item.identifier, rel) if tagged else (item.identifier, rel))
        if start == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt) if tagged else self.cache_salt)
        return tuple(keys) if keys else None

    def last_keyed_block(self, num_blocks: int, block_size: int) -> int:
        """Index of the last of ``num_blocks`` blocks with extra keys (-1: none): every block
        after it hashes with None, which the hasher's fast path takes."""
        if self.fixed is not None or self.lora_name:
            return num_blocks - 1
        last = 0 if self.cache_salt and num_blocks else -1
        if self.mm_items:
            end = self.mm_items[-1].offset + self.mm_items[-1].length
            last = max(last, min(num_blocks, -(-end // block_size)) - 1)
        return last
