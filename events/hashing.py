"""Block identity (DESIGN.md 3.1): vLLM's ``sha256_cbor`` chain, and a faster xxh3-128 option.

``digest = H(canonical_CBOR([parent_digest or NONE_HASH, [token ids], extra_keys or null]))``
with ``NONE_HASH = H(canonical_CBOR(str(seed)))``. Blocks chain on the full digest; the wire
form is the last 8 bytes as an unsigned big-endian int.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import cbor2
import xxhash

from events.schema import BlockHash

HashAlgo = Literal["sha256_cbor", "xxh3_128_cbor"]
HASH_ALGOS: Final[tuple[HashAlgo, ...]] = ("sha256_cbor", "xxh3_128_cbor")
DIGEST_BYTES: Final[dict[HashAlgo, int]] = {"sha256_cbor": 32, "xxh3_128_cbor": 16}


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


_DIGESTS: Final[dict[HashAlgo, Callable[[bytes], bytes]]] = {
    "sha256_cbor": _sha256,
    "xxh3_128_cbor": _xxh3_128,
}


def canonical_cbor(value: Any) -> bytes:
    return cbor2.dumps(value, canonical=True)


def to_wire(digest: bytes) -> BlockHash:
    """The 64-bit form published on the ZMQ wire and used by the reducer."""
    return BlockHash(int.from_bytes(digest[-8:], "big"))


@dataclass(frozen=True)
class BlockHasher:
    """Hashes full blocks of token ids into a chain of digests.

    ``seed`` plays the role of vLLM's PYTHONHASHSEED: engines that should share hashes must
    use the same seed, algorithm and block size.
    """

    seed: str = "0"
    block_size: int = 16
    algo: HashAlgo = "sha256_cbor"

    def __post_init__(self) -> None:
        if self.algo not in _DIGESTS:
            raise ValueError(f"unknown hash algorithm {self.algo!r}; choose one of {HASH_ALGOS}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")

    @property
    def digest_bytes(self) -> int:
        return DIGEST_BYTES[self.algo]

    @property
    def none_hash(self) -> bytes:
        return _DIGESTS[self.algo](canonical_cbor(str(self.seed)))

    def hash_block(
        self, parent: bytes | None, token_ids: Sequence[int], extra_keys: Sequence[Any] | None = None
    ) -> bytes:
        """Digest of one block given its parent's digest (None for the first block)."""
        parent_digest = self.none_hash if parent is None else parent
        keys = None if extra_keys is None else tuple(extra_keys)
        payload = canonical_cbor([parent_digest, [int(t) for t in token_ids], keys])
        return _DIGESTS[self.algo](payload)

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        parent: bytes | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> list[bytes]:
        """Digests of every full block of ``token_ids``; a trailing partial block is skipped."""
        out: list[bytes] = []
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = self.hash_block(parent, token_ids[start : start + bs], extra_keys)
            out.append(parent)
        return out
