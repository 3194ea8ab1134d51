"""One KV-cache group's blocks: free LRU queue, prefix-cache hash map, and the events they cause.

State lives in three explicit collections (as in nano-vllm): ``blocks`` (ref counts and
digests), ``free_queue`` (LRU order, evicted from the front) and ``hash_to_block``. Events are
recorded where the state changes (as in vLLM's block pool) into a list shared by every group's
pool, so the drained order is the mutation order.

Departure from vLLM, on purpose: a hash maps to at most one block per group. When a block
becomes full with a digest that another block already holds (two requests computed the same
prefix in the same step), the request switches to the cached block and its own copy is freed
unhashed; no ``BlockStored`` is emitted, so every ``BlockStored`` is matched by exactly one
later ``BlockRemoved`` or ``AllBlocksCleared``, and a request's full blocks are all cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import EngineError
from events.hashing import to_wire, to_wire_many
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, Event, SpecKind

NULL_BLOCK_ID = 0
"""Stands in for sliding-window blocks that no query can see any more; never allocated."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    digest: bytes | None = None
    # Kept while hashed, so the pool can re-announce itself (snapshot_events) after a reset.
    parent: bytes | None = None
    token_ids: tuple[int, ...] = ()
    depth: int = 0


class NoFreeBlocks(EngineError, RuntimeError):
    """allocate() was asked for more blocks than are free (callers check num_free_blocks first)."""


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        group_idx: int,
        kind: SpecKind,
        sliding_window: int | None,
        events: list[Event],
    ) -> None:
        self.block_size = block_size
        self.group_idx = group_idx
        self.kind: SpecKind = kind
        self.sliding_window = sliding_window
        # Block 0 is the null block; real blocks are 1..num_blocks.
        self.blocks = [Block(i) for i in range(num_blocks + 1)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks + 1))
        self.hash_to_block: dict[bytes, int] = {}
        self.version = 0
        """Counts changes of ``hash_to_block`` (a match made at an equal version still holds)."""
        self._events = events

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_cached_block(self, digest: bytes) -> int | None:
        return self.hash_to_block.get(digest)

    def blocks_for(self, digest: bytes) -> int:
        """The block holding ``digest`` (the caller checked it is cached)."""
        return self.hash_to_block[digest]

    def num_reclaimable(self, block_ids: Sequence[int]) -> int:
        """How many of these (cached) blocks sit in the free queue and would leave it on touch."""
        blocks = self.blocks
        return sum([1 for b in block_ids if b != NULL_BLOCK_ID and blocks[b].ref_cnt == 0])

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the LRU queue."""
        blocks, free_queue = self.blocks, self.free_queue
        for b in block_ids:
            if b:  # not the null block
                blk = blocks[b]
                if not blk.ref_cnt:
                    del free_queue[b]
                blk.ref_cnt += 1

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue, evicting their cached hashes."""
        if n > len(self.free_queue):
            raise NoFreeBlocks(f"group {self.group_idx}: need {n} blocks, {len(self.free_queue)} free")
        out: list[int] = []
        for _ in range(n):
            b, _unused = self.free_queue.popitem(last=False)
            blk = self.blocks[b]
            if blk.digest is not None:
                self._evict(blk)
            blk.ref_cnt = 1
            out.append(b)
        # Ascending ids: which fresh block holds which position does not matter, and blocks
        # that follow on in memory let a load or store of adjacent slots move as one copy per
        # run (the queue often holds a freed request's blocks in reverse order).
        out.sort()
        return out

    def uncache(self, block_ids: Sequence[int]) -> None:
        """Forget the digests of these blocks (their KV turned out wrong): BlockRemoved each."""
        for b in block_ids:
            blk = self.blocks[b]
            if blk.digest is not None:
                self._evict(blk)

    def _evict(self, blk: Block) -> None:
        assert blk.digest is not None
        if self.hash_to_block.get(blk.digest) == blk.block_id:
            del self.hash_to_block[blk.digest]
            self.version += 1
        self._events.append(
            BlockRemoved(block_hashes=(to_wire(blk.digest),), medium="GPU", group_idx=self.group_idx)
        )
        blk.digest = None

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference each, in the given order; cached blocks join the LRU tail, others
        the front (nothing to keep them for)."""
        blocks, free_queue = self.blocks, self.free_queue
        for b in block_ids:
            if b:  # not the null block
                blk = blocks[b]
                assert blk.ref_cnt > 0, f"double free of block {b}"
                blk.ref_cnt -= 1
                if not blk.ref_cnt:
                    free_queue[b] = None
                    if blk.digest is None:
                        free_queue.move_to_end(b, last=False)

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        digests: Sequence[bytes],
        token_ids: Sequence[int],
        parent: bytes | None,
        depth: int = 0,
        chunks: Sequence[tuple[int, ...]] | None = None,
    ) -> list[int | None]:
        """Give newly full blocks their digests; one ``BlockStored`` per contiguous run.

        ``token_ids`` covers exactly these blocks; ``parent`` is the digest before the first,
        ``depth`` the first block's index in its chain; ``chunks``: each block's tokens as a
        tuple, when the caller made them already (the blocks keep them).
        Returns, per block, None when it was registered, or the block that already holds its
        digest (the caller swaps to that block, so a request's chain stays all cached).
        """
        bs = self.block_size
        blocks = self.blocks
        cached = self.hash_to_block
        # Slices of a tuple are tuples: one copy per block, not a list and then a tuple.
        tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
        if chunks is None:
            chunks = [tokens[i : i + bs] for i in range(0, len(digests) * bs, bs)]
        result: list[int | None] = list(map(cached.get, digests))
        n = len(result)
        if n and result.count(None) == n:
            # The common case (a prefill's or a load's blocks, none cached yet): one run, the
            # hash map filled in C. A chain's digests are distinct (each covers its parent).
            for blk, digest, prev, chunk, d in zip(map(blocks.__getitem__, block_ids), digests,
                                                    (parent, *digests[: n - 1]), chunks, range(depth, depth + n), strict=True):
                assert blk.block_id != NULL_BLOCK_ID and blk.digest is None, f"block {blk.block_id} cannot take a hash"
                blk.digest, blk.parent, blk.token_ids, blk.depth = digest, prev, chunk, d
            cached.update(zip(digests, block_ids, strict=True))
            self.version += 1
            self._emit_stored(range(n), digests, tokens, parent)
            return result
        result = []
        run: list[int] = []
        run_parent = parent
        prev = parent
        for i, (b, digest) in enumerate(zip(block_ids, digests, strict=True)):
            existing = cached.get(digest)
            if existing is not None:
                self._emit_stored(run, digests, tokens, run_parent)
                run = []
                result.append(existing)
            else:
                blk = blocks[b]
                assert b != NULL_BLOCK_ID and blk.digest is None, f"block {b} cannot take a hash"
                blk.digest = digest
                blk.parent = prev
                blk.token_ids = chunks[i]
                blk.depth = depth + i
                cached[digest] = b
                self.version += 1
                result.append(None)
                if not run:
                    run_parent = prev
                run.append(i)
            prev = digest
        self._emit_stored(run, digests, tokens, run_parent)
        return result

    def _emit_stored(
        self, run: Sequence[int], digests: Sequence[bytes], token_ids: Sequence[int], parent: bytes | None
    ) -> None:
        if not run:
            return
        bs = self.block_size
        self._events.append(
            BlockStored(
                block_hashes=tuple(to_wire_many(digests[run[0] : run[-1] + 1])),
                parent_block_hash=None if parent is None else to_wire(parent),
                # A run is consecutive blocks: one slice of the (int) token ids.
                token_ids=tuple(token_ids[run[0] * bs : (run[-1] + 1) * bs]),
                block_size=bs,
                medium="GPU",
                group_idx=self.group_idx,
                kv_cache_spec_kind=self.kind,
                sliding_window=self.sliding_window,
            )
        )

    def snapshot_events(self) -> list[BlockStored]:
        """One BlockStored per cached block, parents before children: the pool as events."""
        cached = sorted((self.blocks[b] for b in self.hash_to_block.values()), key=lambda blk: (blk.depth, blk.block_id))
        out: list[BlockStored] = []
        for blk in cached:
            assert blk.digest is not None
            out.append(
                BlockStored(
                    block_hashes=(to_wire(blk.digest),),
                    parent_block_hash=None if blk.parent is None else to_wire(blk.parent),
                    token_ids=blk.token_ids,
                    block_size=self.block_size,
                    medium="GPU",
                    group_idx=self.group_idx,
                    kv_cache_spec_kind=self.kind,
                    sliding_window=self.sliding_window,
                )
            )
        return out

    def has_blocks_in_use(self) -> bool:
        return any(b.ref_cnt > 0 for b in self.blocks[1:])

    def clear_hashes(self) -> None:
        """Forget every cached digest (the caller emits one AllBlocksCleared for all groups)."""
        for blk in self.blocks:
            blk.digest = None
        self.hash_to_block.clear()
        self.version += 1


def all_blocks_cleared() -> AllBlocksCleared:
    return AllBlocksCleared(medium="GPU")
