"""The router's hot path to block hashes: a tokenized prompt to the wire hashes of its full
blocks, the same values as ``events.hashing.BlockHasher`` (which defines them; tests check one
against the other), in about a third of the time.

Per request the router hashes the prompt once (DECISIONS 36). The owner's general fast path
encodes every id's CBOR with a (n, 9)-byte table and a boolean mask, then joins five pieces
per block and converts each digest to its wire form in Python. Token ids of real vocabularies
are below 2**16, so here the CBOR of every block, framed as ``[ids...]`` and followed by the
``null`` of the extra keys, is scattered straight into one buffer (a 1-, 2- or 3-byte code per
id); the chain is then one concatenation and one digest per block, and the wire forms are read
from all digests at once. Prompts with larger ids take the owner's path (DECISIONS 54).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from events.hashing import BlockHasher, cbor_head, to_wire
from events.schema import BlockHash

_DIGEST: dict[str, Callable[[bytes], bytes]] = {
    "sha256_cbor": lambda data: hashlib.sha256(data).digest(),
    "xxh3_128_cbor": xxhash.xxh3_128_digest,
}
_SMALL = 1 << 16
"""Ids below this encode in at most 3 bytes: the fast path's case."""


class PromptHasher:
    """Wire hashes of a prompt's full blocks for one ``BlockHasher`` (seed, size, algorithm)."""

    def __init__(self, hasher: BlockHasher) -> None:
        self.hasher = hasher
        self.block_size = hasher.block_size
        self._digest = _DIGEST[hasher.algo]
        self._none = bytes(hasher.none_hash)
        # [parent, [ids], null]: the array head, then the parent's byte-string head (every
        # parent, the seed's digest included, has the algorithm's digest length).
        self._head = b"\x83" + cbor_head(2, hasher.digest_bytes)
        self._ids_head = cbor_head(4, self.block_size)
        self._words = hasher.digest_bytes // 8

    def wire(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The wire hashes of every full block of ``token_ids`` (a trailing partial block is
        skipped); none when an id is negative (engines refuse such a prompt: nothing to reuse).
        Ids of 2**16 and more take the owner's general path."""
        bs = self.block_size
        n = len(token_ids) // bs
        if n == 0:
            return []
        segments = self._segments(token_ids, n)
        if segments is None:
            if any(t < 0 for t in token_ids[: n * bs]):
                return []
            return [to_wire(d) for d in self.hasher.hash_blocks(token_ids[: n * bs])]
        digest, head = self._digest, self._head
        parent = self._none
        digests: list[bytes] = []
        append = digests.append
        for seg in segments:
            parent = digest(head + parent + seg)
            append(parent)
        last_words = np.frombuffer(b"".join(digests), dtype=">u8")[self._words - 1 :: self._words]
        return last_words.tolist()  # type: ignore[no-any-return]

    def _segments(self, token_ids: Sequence[int], n: int) -> list[bytes] | None:
        """Per block, the CBOR of ``[ids...]`` and the ``null`` after it; None when some id is
        not an int in [0, 2**16)."""
        bs = self.block_size
        count = n * bs
        try:
            ids = np.fromiter(token_ids[:count] if len(token_ids) != count else token_ids, dtype=np.int64, count=count)
        except (TypeError, ValueError, OverflowError):
            return None
        if int(ids.min()) < 0 or int(ids.max()) >= _SMALL:
            return None
        width = (ids >= 24).astype(np.int64)
        width += ids >= 256
        sizes = width + 1
        # Each block adds its ids' head before them and a null after them.
        lead = len(self._ids_head)
        per_block = sizes.reshape(n, bs).sum(axis=1) + lead + 1
        block_ends = np.cumsum(per_block)
        block_starts = block_ends - per_block
        starts = np.cumsum(sizes) - sizes
        starts += np.repeat(np.arange(n, dtype=np.int64) * (lead + 1) + lead, bs)
        out = np.empty(int(block_ends[-1]), dtype=np.uint8)
        for k, byte in enumerate(self._ids_head):
            out[block_starts + k] = byte
        out[block_ends - 1] = 0xF6
        out[starts] = np.where(width == 0, ids, 0x17 + width)
        one = width == 1
        out[starts[one] + 1] = ids[one]
        two = width == 2
        at, v = starts[two], ids[two]
        out[at + 1] = v >> 8
        out[at + 2] = v & 0xFF
        flat = out.tobytes()
        return [flat[a:b] for a, b in zip(block_starts.tolist(), block_ends.tolist(), strict=True)]
