"""Block identity (DESIGN.md 3.1): vLLM's ``sha256_cbor`` chain, and a faster xxh3-128 option.

``digest = H(canonical_CBOR([parent_digest or NONE_HASH, [token ids], extra_keys or null]))``
with ``NONE_HASH = H(canonical_CBOR(str(seed)))``. Blocks chain on the full digest; the wire
form is the last 8 bytes as an unsigned big-endian int.

The seed follows vLLM (``resolve_none_hash_seed`` in vllm/v1/core/kv_cache_utils.py): the value
of ``PYTHONHASHSEED`` when set, else the fixed string ``"vllm-none-hash"``, so engines of a fleet
agree without configuration (:func:`env_hash_seed`; a :class:`BlockHasher` built without a seed
reads the environment as vLLM's ``init_none_hash`` does, everything else takes it explicitly). A request's extra keys per block (LoRA, cache salt, multimodal items) are built by
:class:`events.extra_keys.RequestKeys` and hashed by :meth:`BlockHasher.hash_request`.

Hashing a 4096-token prompt is on every request's path (the engine's prefix match, the
router's prediction), so the common case (no extra keys, a bytes parent, token ids that are
integers in [0, 2**32): every real vocabulary) has a fast path: the canonical CBOR of every
block's ``[ids...]`` and the ``null`` after it is scattered by numpy into one buffer (each id's
code is 1, 2, 3 or 5 bytes), then each block costs one concatenation and one digest; the wire
forms are read from all digests at once (:meth:`BlockHasher.wire_hashes`). Anything
else, and prompts of a few blocks (numpy's fixed cost is more than cbor2's), goes through
cbor2. Both give the same bytes (tests/events/test_hashing.py checks one against the other).
numpy is imported on the first such encoding, not with this module: the daemon and the bridge
use only :func:`to_wire` and the algorithm names, and numpy's import was ~0.1 s of the
daemon's start.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

import cbor2
import xxhash

from events.extra_keys import RequestKeys
from events.schema import BlockDigest, BlockHash

if TYPE_CHECKING:
    import numpy as np

HashAlgo = Literal["sha256_cbor", "xxh3_128_cbor"]
HASH_ALGOS: Final[tuple[HashAlgo, ...]] = ("sha256_cbor", "xxh3_128_cbor")
DIGEST_BYTES: Final[dict[HashAlgo, int]] = {"sha256_cbor": 32, "xxh3_128_cbor": 16}


def _sha256(data: bytes) -> BlockDigest:
    return BlockDigest(hashlib.sha256(data).digest())


def _xxh3_128(data: bytes) -> BlockDigest:
    return BlockDigest(xxhash.xxh3_128_digest(data))


DEFAULT_SEED: Final = "vllm-none-hash"
"""vLLM's ``DEFAULT_NONE_HASH_SEED``: the seed of an engine started without PYTHONHASHSEED."""


def env_hash_seed(env: Mapping[str, str]) -> str:
    """The seed a vLLM engine started with environment ``env`` uses: PYTHONHASHSEED, else
    :data:`DEFAULT_SEED`. (vLLM draws a random seed for its non-cryptographic xxhash algorithms
    instead; nobody can match those hashes, so we keep the fixed seed for xxh3 too: DECISIONS.)"""
    return env.get("PYTHONHASHSEED", DEFAULT_SEED)


_DIGESTS: Final[dict[HashAlgo, Callable[[bytes], BlockDigest]]] = {
    "sha256_cbor": _sha256,
    "xxh3_128_cbor": _xxh3_128,
}

_FAST_ID_LIMIT: Final = 1 << 32
"""Ids below this take the fast path (a CBOR code of at most 5 bytes); larger ones, cbor2."""
_FAST_MIN_BLOCKS: Final = 12
"""Fewer blocks go through cbor2 (~3 us a block): the fast path's numpy calls cost ~40 us."""


def canonical_cbor(value: Any) -> bytes:
    return cbor2.dumps(value, canonical=True)


def cbor_head(major: int, n: int) -> bytes:
    """The canonical (shortest) CBOR head of major type ``major`` with argument ``n``."""
    if n < 24:
        return bytes((major << 5 | n,))
    for ai, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes((major << 5 | ai,)) + n.to_bytes(size, "big")
    raise OverflowError(f"CBOR argument {n} does not fit in 64 bits")


def int_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray | None:
    """``token_ids`` as a 1-D integer array: an integer array as it is, a sequence packed by
    struct in C (~30 us for 4,096 ids, what int() takes: ints, bools, numpy ints); None when
    some id is not an integer that fits int64 (a float, a string, a bignum)."""
    import numpy as np

    if isinstance(token_ids, np.ndarray):
        return token_ids if token_ids.ndim == 1 and token_ids.dtype.kind in "iu" else None
    try:
        return np.frombuffer(struct.pack(f"{len(token_ids)}q", *token_ids), dtype=np.int64)
    except struct.error:
        return None


def _block_payloads(ids: np.ndarray, block_size: int) -> list[bytes] | None:
    """Per full block of ``ids``, the canonical CBOR of ``[ids...]`` followed by the ``null``
    of the extra keys: a block's CBOR after its parent's. None when some id is negative or
    not below _FAST_ID_LIMIT. Every id's code (1, 2, 3 or 5 bytes) and every block's frame are
    scattered by numpy into one buffer, then cut per block."""
    import numpy as np

    n = len(ids) // block_size
    v = ids[: n * block_size]
    top = int(v.max())
    if int(v.min()) < 0 or top >= _FAST_ID_LIMIT:
        return None
    v = v.astype(np.int64, copy=False)
    width = (v >= 24).astype(np.int64)  # 0: in the head; 1, 2, 3: 1, 2 or 4 bytes after it
    width += v >= 1 << 8
    sizes = width + 1
    classes: tuple[tuple[int, int], ...] = ((1, 1), (2, 2))  # (width, bytes after the head)
    if top >= 1 << 16:  # 4 bytes after the head: the vocabulary's upper part, if it has one
        width += v >= 1 << 16
        sizes = width + 1 + (width == 3)
        classes += ((3, 4),)
    lead = cbor_head(4, block_size)
    frame = len(lead) + 1  # each block adds its ids' head before them and a null after them
    per_block = sizes.reshape(n, block_size).sum(axis=1) + frame
    block_ends = np.cumsum(per_block)
    block_starts = block_ends - per_block
    starts = np.cumsum(sizes) - sizes
    starts += np.repeat(np.arange(n, dtype=np.int64) * frame + len(lead), block_size)
    out = np.empty(int(block_ends[-1]), dtype=np.uint8)
    for k, byte in enumerate(lead):
        out[block_starts + k] = byte
    out[block_ends - 1] = 0xF6
    out[starts] = np.where(width == 0, v, 0x17 + width)
    for cls, nbytes in classes:
        sel = width == cls
        at, x = starts[sel] + 1, v[sel]
        for k in range(nbytes):
            out[at + k] = (x >> (8 * (nbytes - 1 - k))) & 0xFF
    flat = out.tobytes()
    return [flat[a:b] for a, b in zip(block_starts.tolist(), block_ends.tolist(), strict=True)]


# Digests in: ``BlockDigest | bytes`` until the engine and offloadd hold typed digests (their
# block tables still say ``bytes``); digests out are always ``BlockDigest``.
def to_wire(digest: BlockDigest | bytes) -> BlockHash:
    """The 64-bit form of a digest: published on the ZMQ wire and used by the reducer."""
    return BlockHash(int.from_bytes(digest[-8:], "big"))


def to_wire_many(digests: Sequence[BlockDigest | bytes]) -> list[BlockHash]:
    """``to_wire`` of each digest, in one C pass when they all have the same length (a chain's
    do): the digests joined and their last 8 bytes read by one ``struct`` unpack (256 digests
    ~8x faster than a call per digest)."""
    n = len(digests)
    size = len(digests[0]) if n else 0
    if n < 2 or size < 8 or list(map(len, digests)).count(size) != n:
        return list(map(to_wire, digests))
    return list(_wire_struct(size, n).unpack(b"".join(digests)))


@functools.lru_cache(maxsize=64)
def _wire_struct(size: int, count: int) -> struct.Struct:
    """Reads the last 8 bytes (big-endian) of each of ``count`` joined ``size``-byte digests."""
    return struct.Struct(">" + f"{size - 8}xQ" * count if size > 8 else f">{count}Q")


@dataclass(frozen=True)
class BlockHasher:
    """Hashes full blocks of token ids into a chain of digests.

    ``seed`` plays the role of vLLM's PYTHONHASHSEED; by default it is vLLM's: $PYTHONHASHSEED,
    else :data:`DEFAULT_SEED`. Engines that should share hashes must use the same seed,
    algorithm and block size.
    """

    seed: str = field(default_factory=lambda: env_hash_seed(os.environ))
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

    @functools.cached_property
    def none_hash(self) -> BlockDigest:
        return _DIGESTS[self.algo](canonical_cbor(str(self.seed)))

    def hash_block(
        self,
        parent: BlockDigest | bytes | None,
        token_ids: Sequence[int],
        extra_keys: Sequence[Any] | None = None,
    ) -> BlockDigest:
        """Digest of one block given its parent's digest (None for the first block)."""
        return self._hash_general(self.none_hash if parent is None else parent, token_ids, extra_keys)

    def hash_blocks(
        self,
        token_ids: Sequence[int] | np.ndarray,
        parent: BlockDigest | bytes | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> list[BlockDigest]:
        """Digests of every full block of ``token_ids`` (a list, or a 1-D integer array: no
        conversion); a trailing partial block is skipped."""
        bs = self.block_size
        end = len(token_ids) - len(token_ids) % bs
        parent_digest = self.none_hash if parent is None else parent
        if extra_keys is None and type(parent_digest) is bytes and end >= _FAST_MIN_BLOCKS * bs:
            ids = int_array(token_ids if end == len(token_ids) else token_ids[:end])
            payloads = None if ids is None else _block_payloads(ids, bs)
            if payloads is not None:
                return self._chain(parent_digest, payloads)
        out: list[BlockDigest] = []
        for start in range(0, end, bs):
            parent_digest = self._hash_general(parent_digest, token_ids[start : start + bs], extra_keys)
            out.append(parent_digest)
        return out

    def wire_hashes(self, token_ids: Sequence[int] | np.ndarray) -> list[BlockHash]:
        """``to_wire`` of every digest of ``hash_blocks(token_ids)``, read from all at once."""
        digests = self.hash_blocks(token_ids)
        if not digests:
            return []
        import numpy as np

        words = self.digest_bytes // 8
        return np.frombuffer(b"".join(digests), dtype=">u8")[words - 1 :: words].tolist()  # type: ignore[no-any-return]

    def hash_request(
        self,
        token_ids: Sequence[int] | np.ndarray,
        keys: RequestKeys | None = None,
    ) -> list[BlockDigest]:
        """Digests of every full block of a request whose blocks carry ``keys`` (vLLM's
        per-block extra keys); the blocks after the last keyed one take the fast path."""
        bs = self.block_size
        num_blocks = len(token_ids) // bs
        last = -1 if keys is None else keys.last_keyed_block(num_blocks, bs)
        out: list[BlockDigest] = []
        parent: bytes = self.none_hash
        for i in range(last + 1):
            start = i * bs
            extra = keys.for_block(start, start + bs) if keys is not None else None
            parent = self._hash_general(parent, token_ids[start : start + bs], extra)
            out.append(BlockDigest(parent))
        rest = token_ids[(last + 1) * bs : num_blocks * bs]
        return out + self.hash_blocks(rest, parent=parent) if len(rest) else out

    def hash_blocks_general(
        self,
        token_ids: Sequence[int],
        parent: BlockDigest | bytes | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> list[BlockDigest]:
        """``hash_blocks`` through cbor2 only: the definition the fast path is checked against."""
        bs = self.block_size
        parent_digest = self.none_hash if parent is None else parent
        out: list[BlockDigest] = []
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent_digest = self._hash_general(parent_digest, token_ids[start : start + bs], extra_keys)
            out.append(parent_digest)
        return out

    def _hash_general(
        self,
        parent: bytes,
        token_ids: Sequence[int] | np.ndarray,
        extra_keys: Sequence[Any] | None,
    ) -> BlockDigest:
        keys = None if extra_keys is None else tuple(extra_keys)
        payload = canonical_cbor([parent, [int(t) for t in token_ids], keys])
        return _DIGESTS[self.algo](payload)

    def _chain(self, parent: bytes, payloads: list[bytes]) -> list[BlockDigest]:
        """Chain over blocks whose CBOR after the parent is ``payloads[i]``: [parent, [ids], null]."""
        digest = _DIGESTS[self.algo]
        head = b"\x83" + cbor_head(2, len(parent))
        # Every parent after the first is one of our digests, so its head is fixed.
        chained = b"\x83" + cbor_head(2, self.digest_bytes)
        out: list[BlockDigest] = []
        append = out.append
        for payload in payloads:
            parent = digest(head + parent + payload)
            append(parent)
            head = chained
        return out
