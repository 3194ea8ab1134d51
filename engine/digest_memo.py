"""Block digests remembered across requests: a block seen before (same parent digest, same
tokens) is looked up, not hashed again.

A prefix hit's request is new, so its blocks used to be hashed from scratch before the GPU pool
could be matched: for a 4,096-token prompt, 256 sha256 digests (~1 ms of host time, most of a
GPU hit's host work). A digest is a pure function of the hasher's seed, algorithm and block
size, the parent digest and the block's tokens, so a memo of them is exact: the same digests,
hence the same matches and events. Looking a block up costs a slice of the tokens' bytes and
one dict probe; the first block not remembered and every block after it are hashed (in one
call, the hasher's fast path) and remembered.

Bounded: past ``capacity`` entries the older half is dropped (insertion order), so the memo
holds at most about the recent ``capacity`` blocks; sized from the GPU pool, it covers every
block a prefix hit can match.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from events.hashing import BlockHasher


class DigestMemo:
    """``hash_blocks`` as :class:`BlockHasher` has it, remembering what it computed."""

    def __init__(self, hasher: BlockHasher, capacity: int) -> None:
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.capacity = max(1, capacity)
        self._known: dict[tuple[bytes | None, bytes], bytes] = {}
        self.hits = 0
        """Blocks answered from the memo (for tests and profiles)."""

    def __len__(self) -> int:
        return len(self._known)

    def hash_blocks(self, token_ids: Sequence[int] | np.ndarray, parent: bytes | None = None) -> list[bytes]:
        """Digests of every full block of ``token_ids`` chained after ``parent``; a trailing
        partial block is skipped."""
        bs = self.block_size
        n = len(token_ids) // bs
        if n == 0:
            return []
        try:
            ids = np.asarray(token_ids[: n * bs], dtype=np.int64)  # an int64 array: no copy
        except OverflowError:  # no such token reaches here (ids are checked): hash as given
            return list(self.hasher.hash_blocks(token_ids, parent))
        raw, width = ids.tobytes(), bs * 8
        known = self._known
        out: list[bytes] = []
        prev = parent
        for i in range(n):
            digest = known.get((prev, raw[i * width : (i + 1) * width]))
            if digest is None:
                break
            out.append(digest)
            prev = digest
        have = len(out)
        self.hits += have
        if have == n:
            return out
        rest = self.hasher.hash_blocks(ids[have * bs :], prev)
        for i, digest in enumerate(rest, start=have):
            known[(prev, raw[i * width : (i + 1) * width])] = digest
            prev = digest
        out.extend(rest)
        if len(known) > self.capacity:
            # Drop the older half at once (removing from the front one at a time is slow).
            self._known = dict(itertools.islice(known.items(), len(known) - self.capacity // 2, None))
        return out
