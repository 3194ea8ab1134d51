"""Block tables of running requests over every KV-cache group: prefix hits, slot allocation,
sliding-window freeing, and registration of newly full blocks."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import takewhile

from engine.block_pool import NULL_BLOCK_ID, BlockPool, all_blocks_cleared
from engine.digest_memo import DigestMemo
from engine.kv_cache import KVCacheGroupSpec, first_visible_block
from engine.kv_connector import NewBlocks
from engine.request import Request
from events.hashing import BlockHasher
from events.schema import Event


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        specs: list[KVCacheGroupSpec],
        num_blocks: int,
        block_size: int,
        hasher: BlockHasher | DigestMemo,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.hasher = hasher
        self.enable_prefix_caching = enable_prefix_caching
        self._events: list[Event] = []
        self.pools = [
            BlockPool(num_blocks, block_size, s.group_idx, s.kind, s.sliding_window, self._events)
            for s in specs
        ]
        self.block_tables: dict[str, list[list[int]]] = {}
        self._no_windows = all(s.sliding_window is None for s in specs)

    def take_events(self) -> list[Event]:
        """Drain the events recorded since the last call, in mutation order."""
        out = list(self._events)
        self._events.clear()
        return out

    @property
    def version(self) -> int:
        """Changes of every pool's prefix-cache map so far: ``find_prefix_hit`` answers the same
        for a request while this stays the same."""
        return sum(p.version for p in self.pools)

    def prompt_digests(self, req: Request) -> list[bytes]:
        """The digests ``find_prefix_hit`` returns (those of the blocks a hit may cover)."""
        if not self.enable_prefix_caching:
            return []
        return req.block_digests(self.hasher, (req.num_tokens - 1) // self.block_size)

    def find_prefix_hit(self, req: Request) -> tuple[int, list[bytes]]:
        """Longest usable cached prefix in blocks, and the digests of the request's full blocks
        (at least one token is always left to compute, so the last token's logits exist)."""
        if not self.enable_prefix_caching:
            return 0, []
        bs = self.block_size
        digests = self.prompt_digests(req)
        limit = len(digests)
        for pool in self.pools:
            if pool.sliding_window is None:
                # The cached run from the start, counted in C (a Python loop was ~0.1 us a block).
                limit = len(list(takewhile(pool.hash_to_block.__contains__, digests[:limit])))
        for n in range(limit, 0, -1):
            if all(
                pool.get_cached_block(d) is not None
                for pool in self.pools
                if pool.sliding_window is not None
                for d in digests[first_visible_block(n * bs, pool.sliding_window, bs) : n]
            ):
                return n, digests
        return 0, digests

    def hold_blocks(self, digests: list[bytes], num_hit: int) -> list[list[int]]:
        """Take a reference on the cached blocks of a ``num_hit``-block prefix hit, in every
        group those that admission takes (a sliding window's visible ones); per group, for
        ``release_blocks`` (engine.prefix_holds)."""
        bs = self.block_size
        table: list[list[int]] = []
        for pool in self.pools:
            first = min(first_visible_block(num_hit * bs, pool.sliding_window, bs), num_hit)
            cached = pool.hash_to_block
            ids = list(map(cached.__getitem__, digests[first:num_hit]))
            pool.touch(ids)
            table.append(ids)
        return table

    def release_blocks(self, table: list[list[int]]) -> None:
        """Drop the references ``hold_blocks`` took (tail blocks first, as ``free``)."""
        for pool, ids in zip(self.pools, table, strict=True):
            pool.free(ids[::-1])

    def allocate_for_admission(
        self, req: Request, digests: list[bytes], num_hit: int, num_external: int, num_new_tokens: int,
        held: list[list[int]] | None = None, held_are_hits: bool = False,
    ) -> dict[int, list[int]] | None:
        """Take the hit blocks and allocate the rest; None (and no change) when blocks run short.

        ``held``: the references a hold took for this request (``hold_blocks``). On success they
        are the admission's: a group whose held blocks are its hits keeps them as they are (no
        second reference taken and the hold's dropped, the same state at a third of the work),
        any other group's are released after its hits are taken. On None they stay the caller's.
        ``held_are_hits``: the caller knows that ``held`` are exactly the hits (the hold was
        matched at the current ``version`` with this ``num_hit``): they are not looked up again.

        Returns, per group, the blocks allocated for the ``num_external`` blocks to load."""
        bs = self.block_size
        num_computed = (num_hit + num_external) * bs
        total = _cdiv(num_computed + num_new_tokens, bs)
        plans: list[tuple[BlockPool, list[int], int, int, list[int] | None]] = []
        for g, pool in enumerate(self.pools):
            first = min(first_visible_block(num_hit * bs, pool.sliding_window, bs), num_hit)
            if held is not None and held_are_hits:
                taken = held[g]
            else:
                taken = list(map(pool.hash_to_block.__getitem__, digests[first:num_hit]))  # in C
            hits = [NULL_BLOCK_ID] * first + taken if first else taken
            # None: the hold's blocks are these hits (held blocks are referenced: none reclaimable).
            release = None if held is None or held[g] is taken or held[g] == taken else held[g]
            # Loaded sliding-window blocks that are already outside the window stay null: never
            # read, so neither allocated, loaded nor hashed (the offload tier needs only the window).
            skip = min(first_visible_block(num_computed, pool.sliding_window, bs), num_hit + num_external) - num_hit
            skip = max(0, skip)
            need = total - num_hit - skip
            adopted = held is not None and release is None
            if pool.num_free_blocks - (0 if adopted else pool.num_reclaimable(hits)) < need:
                return None
            plans.append((pool, hits, need, skip, None if adopted else release or []))
        table: list[list[int]] = []
        loads: dict[int, list[int]] = {}
        for pool, hits, need, skip, release in plans:
            if release is not None:
                pool.touch(hits)
                pool.free(release[::-1])
            fresh = [NULL_BLOCK_ID] * skip + pool.allocate(need)
            table.append(hits + fresh)
            loads[pool.group_idx] = fresh[:num_external]
        self.block_tables[req.request_id] = table
        req.num_hashed_blocks = num_hit
        return loads

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Grow a running request's tables to hold ``num_new_tokens`` more tokens; first return
        sliding-window blocks that no query can see any more to the pool."""
        table = self.block_tables[req.request_id]
        total = _cdiv(req.num_computed_tokens + num_new_tokens, self.block_size)
        if self._no_windows and all(len(t) >= total for t in table):
            return True  # most decodes: the tables hold the new slots already, nothing to free
        for pool, blocks in zip(self.pools, table, strict=True):
            first = first_visible_block(req.num_computed_tokens, pool.sliding_window, self.block_size)
            stale = [b for b in blocks[:first] if b != NULL_BLOCK_ID]
            if stale:
                pool.free(list(reversed(stale)))
                blocks[:first] = [NULL_BLOCK_ID] * first
        if any(p.num_free_blocks < total - len(t) for p, t in zip(self.pools, table, strict=True)):
            return False
        for pool, blocks in zip(self.pools, table, strict=True):
            blocks.extend(pool.allocate(total - len(blocks)))
        return True

    def free(self, req: Request) -> None:
        """Release every block of the request; tail blocks first, so they are evicted first."""
        table = self.block_tables.pop(req.request_id, None)
        if table is None:
            return
        for pool, blocks in zip(self.pools, table, strict=True):
            pool.free(blocks[::-1])

    def register_full_blocks(self, req: Request) -> list[NewBlocks]:
        """Hash the blocks that the last step completed; records BlockStored events."""
        bs = self.block_size
        num_full = req.num_computed_tokens // bs
        start = req.num_hashed_blocks
        if not self.enable_prefix_caching or num_full <= start:
            req.num_hashed_blocks = max(start, num_full)
            return []
        digests = req.block_digests(self.hasher, num_full)
        # A tuple: its per-block slices are the tuples that blocks, events and NewBlocks keep
        # (made once, shared by the pools and the NewBlocks).
        tokens = tuple(req.token_ids(start * bs, num_full * bs))
        chunks = [tokens[i : i + bs] for i in range(0, len(tokens), bs)]
        out: list[NewBlocks] = []
        for pool, blocks in zip(self.pools, self.block_tables[req.request_id], strict=True):
            # Null (out-of-window, never loaded) blocks at the front are skipped, not hashed.
            lead = next((i for i in range(num_full - start) if blocks[start + i] != NULL_BLOCK_ID), num_full - start)
            result = [NULL_BLOCK_ID] * lead + pool.cache_full_blocks(
                blocks[start + lead : num_full], digests[start + lead : num_full], tokens[lead * bs :],
                digests[start + lead - 1] if start + lead > 0 else None, start + lead, chunks[lead:],
            )
            fresh: Sequence[int]
            if result.count(None) == len(result):  # the common case: every block is new
                fresh = range(len(result))
            else:
                fresh = [i for i, r in enumerate(result) if r is None]
                for i, existing in enumerate(result):
                    if existing is not None and existing != NULL_BLOCK_ID:
                        # Same tokens, same KV: share the cached block and drop our duplicate.
                        pool.touch([existing])
                        pool.free([blocks[start + i]])
                        blocks[start + i] = existing
            if len(fresh) == num_full - start:  # the common case: slices, not per-block picks
                parents: tuple[bytes | None, ...] = (digests[start - 1] if start else None, *digests[start : num_full - 1])
                out.append(
                    NewBlocks(
                        request_id=req.request_id,
                        group_idx=pool.group_idx,
                        block_ids=tuple(blocks[start:num_full]),
                        digests=tuple(digests[start:num_full]),
                        block_indices=tuple(range(start, num_full)),
                        parents=parents,
                        token_ids=tuple(chunks),
                    )
                )
            elif fresh:
                out.append(
                    NewBlocks(
                        request_id=req.request_id,
                        group_idx=pool.group_idx,
                        block_ids=tuple(blocks[start + i] for i in fresh),
                        digests=tuple(digests[start + i] for i in fresh),
                        block_indices=tuple(start + i for i in fresh),
                        parents=tuple(digests[start + i - 1] if start + i > 0 else None for i in fresh),
                        token_ids=tuple([chunks[i] for i in fresh]),
                    )
                )
        req.num_hashed_blocks = num_full
        return out

    def forget_blocks(self, new_blocks: Sequence[NewBlocks], bad: set[str], requests: Sequence[Request]) -> set[str]:
        """Un-cache the blocks that the requests in ``bad`` registered this step (their KV is
        wrong; BlockRemoved for each). Returns ``bad`` grown by every request of ``requests``
        whose table holds one of them (it took it as a prefix-cache duplicate): its own
        blocks go too, and it must be computed again like the others."""
        bad = set(bad)
        while True:
            gone = {(nb.group_idx, b) for nb in new_blocks if nb.request_id in bad for b in nb.block_ids}
            more = {
                r.request_id for r in requests
                if r.request_id not in bad and any(
                    (pool.group_idx, b) in gone
                    for pool, blocks in zip(self.pools, self.block_tables.get(r.request_id, ()), strict=False)
                    for b in blocks
                )
            }
            if not more:
                break
            bad |= more
        for pool in self.pools:
            pool.uncache([b for gi, b in gone if gi == pool.group_idx])
        return bad

    def block_table(self, request_id: str) -> list[list[int]]:
        return self.block_tables[request_id]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use, as in vLLM."""
        if any(p.has_blocks_in_use() for p in self.pools):
            return False
        for p in self.pools:
            p.clear_hashes()
        self._events.append(all_blocks_cleared())
        return True

    def snapshot_events(self) -> list[Event]:
        """Every cached block of every group as BlockStored events (parents first): what a
        consumer that lost our stream needs to know to hold the same state again."""
        return [e for p in self.pools for e in p.snapshot_events()]

    @property
    def num_free_blocks(self) -> list[int]:
        return [p.num_free_blocks for p in self.pools]
