"""Block digests remembered across requests: a block seen before (same parent digest, same
tokens) is looked up, not hashed again.

A prefix hit's request is new, so its blocks used to be hashed from scratch before the GPU pool
could be matched: for a 4,096-token prompt, 256 sha256 digests (~1 ms of host time, most of a
GPU hit's host work). A digest is a pure function of the hasher's seed, algorithm and block
size, the parent digest and the block's tokens, so a memo of them is exact: the same digests,
hence the same matches and events.

Two indexes of the same facts. ``_known`` maps (parent digest, a block's token bytes) to the
digest: every fact, looked up block by block. ``_by_tokens`` maps a block's token bytes to the
(parent, digest) stored last for them: all blocks of a prompt are looked up there in one pass
in C (their bytes cut by numpy, ``map(dict.get)``) and the chain is checked with one list
comparison (each block's parent is the digest found before it). Only when that fails (a
block remembered after another parent: the same tokens elsewhere in some chain) does the
lookup go block by block through ``_known``. The first block not remembered and every block
after it are hashed (in one call, the hasher's fast path) and remembered.

Before either, whole runs of ``RUN_BLOCKS`` blocks (counted from the start of the call, so
from a prompt's first block) are looked up in ``_runs``: (parent digest, the run's token bytes)
-> the run's digests. A 4,096-token prompt is then 16 lookups of 2 KiB keys read in order,
not 256 of scattered 128-byte keys and their tuples (on an H200 host the per-block lookups of
a prefix hit took ~0.2-0.35 ms, most of it waiting on memory). A run is remembered once all
its digests are known; the first run not remembered and everything after it go block by block
as above, so a prompt that shares part of a run with another still finds its blocks.

Bounded: past ``capacity`` entries the older half is dropped (insertion order), so the memo
holds at most about the recent ``capacity`` blocks (the runs, ``capacity // RUN_BLOCKS`` runs,
likewise); sized from the GPU pool, it covers every block a prefix hit can match.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from operator import itemgetter
from typing import cast

import numpy as np

from events.hashing import BlockHasher

_PARENT, _DIGEST = itemgetter(0), itemgetter(1)
_ONE_PASS_MIN_BLOCKS = 4
"""Up to this many blocks (a block filled by a decode) are looked up block by block: cheaper there."""
RUN_BLOCKS = 16
"""Blocks per run of ``DigestMemo._runs`` (256 tokens at block size 16)."""


class DigestMemo:
    """``hash_blocks`` as :class:`BlockHasher` has it, remembering what it computed."""

    def __init__(self, hasher: BlockHasher, capacity: int) -> None:
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.capacity = max(1, capacity)
        self._known: dict[tuple[bytes | None, bytes], bytes] = {}
        self._by_tokens: dict[bytes, tuple[bytes | None, bytes]] = {}
        self._runs: dict[tuple[bytes | None, bytes], tuple[bytes, ...]] = {}
        self._block = np.dtype(f"V{8 * self.block_size}")
        """One block of int64 ids as one numpy item: ``tolist()`` makes each block's bytes."""
        self._run = np.dtype(f"V{8 * self.block_size * RUN_BLOCKS}")
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
            ids = np.ascontiguousarray(token_ids[: n * bs], dtype=np.int64)  # an int64 array: no copy
        except OverflowError:  # no such token reaches here (ids are checked): hash as given
            return list(self.hasher.hash_blocks(token_ids, parent))
        runs: list[bytes] = ids[: n // RUN_BLOCKS * RUN_BLOCKS * bs].view(self._run).tolist()
        out, found = self._remembered_runs(runs, parent)
        done = len(out)
        if done == n:
            self.hits += n
            return out
        prev = out[-1] if done else parent
        blocks: list[bytes] = ids[done * bs :].view(self._block).tolist()
        out.extend(self._remembered(blocks, prev))
        have = len(out)
        self.hits += have
        if have < n:
            prev = out[-1] if have else parent
            rest = self.hasher.hash_blocks(ids[have * bs :], prev)
            known, by_tokens = self._known, self._by_tokens
            for block, digest in zip(blocks[have - done :], rest, strict=True):
                known[(prev, block)] = digest
                by_tokens[block] = (prev, digest)
                prev = digest
            out.extend(rest)
        self._remember_runs(runs, found, out, parent)
        if len(self._known) > self.capacity:
            # Drop the older half at once (removing from the front one at a time is slow).
            known = self._known
            self._known = dict(itertools.islice(known.items(), len(known) - self.capacity // 2, None))
            self._by_tokens = {block: (p, d) for (p, block), d in self._known.items()}
        return out

    def _remembered_runs(self, runs: list[bytes], parent: bytes | None) -> tuple[list[bytes], int]:
        """Digests of the leading whole ``runs`` the memo holds, chained after ``parent``, and
        how many runs that is."""
        out: list[bytes] = []
        get = self._runs.get
        prev = parent
        for found, run in enumerate(runs):
            digests = get((prev, run))
            if digests is None:
                return out, found
            out.extend(digests)
            prev = digests[-1]
        return out, len(runs)

    def _remember_runs(self, runs: list[bytes], found: int, digests: list[bytes], parent: bytes | None) -> None:
        """Remember ``runs[found:]`` (their digests are all in ``digests`` now)."""
        if found == len(runs):
            return
        k = RUN_BLOCKS
        table = self._runs
        for j in range(found, len(runs)):
            table[(digests[j * k - 1] if j else parent, runs[j])] = tuple(digests[j * k : (j + 1) * k])
        limit = max(1, self.capacity // k)
        if len(table) > limit:
            self._runs = dict(itertools.islice(table.items(), len(table) - limit // 2, None))

    def _remembered(self, blocks: list[bytes], parent: bytes | None) -> list[bytes]:
        """Digests of the leading ``blocks`` the memo holds, chained after ``parent``."""
        out: list[bytes] = []
        found = list(map(self._by_tokens.get, blocks)) if len(blocks) > _ONE_PASS_MIN_BLOCKS else []
        k = found.index(None) if None in found else len(found)
        if k:
            run = cast("list[tuple[bytes | None, bytes]]", found if k == len(found) else found[:k])
            digests = list(map(_DIGEST, run))
            parents = list(map(_PARENT, run))
            if parents[0] == parent and parents[1:] == digests[:-1]:
                if k == len(blocks):
                    return digests
                out = digests
        prev = out[-1] if out else parent
        known = self._known
        for block in itertools.islice(blocks, len(out), None):
            digest = known.get((prev, block))
            if digest is None:
                break
            out.append(digest)
            prev = digest
        return out
