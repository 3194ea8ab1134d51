"""router.block_hashes: the router's fast path gives exactly the owner's (events.hashing) hashes."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from events.hashing import HASH_ALGOS, BlockHasher, HashAlgo, to_wire
from events.schema import BlockHash
from router.block_hashes import PromptHasher
from router.config import EngineSpec, RouterConfig
from router.service import OFF_LOOP_MIN_SIZE, Router


def _owner(hasher: BlockHasher, ids: list[int]) -> list[int]:
    return [to_wire(d) for d in hasher.hash_blocks_general(ids)]


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("block_size", [1, 16, 23, 24, 32])
def test_same_hashes_as_the_owner(algo: HashAlgo, block_size: int) -> None:
    """Every CBOR width of an id (in the head, 1, 2 and 4 bytes), block heads of one and two
    bytes, trailing partial blocks, empty prompts."""
    rng = random.Random(block_size)
    hasher = BlockHasher("seed", block_size, algo)
    fast = PromptHasher(hasher)
    ranges = [(0, 24), (24, 256), (256, 1 << 16), (1 << 16, 1 << 20)]
    for trial in range(40):
        picks = ranges if trial % 4 == 0 else ranges[:3]  # every 4th prompt leaves the fast path
        ids = [rng.randrange(*rng.choice(picks)) for _ in range(rng.randrange(0, 5 * block_size + 3))]
        assert fast.wire(ids) == _owner(hasher, ids)


def test_edges_of_each_width() -> None:
    hasher = BlockHasher(block_size=4)
    ids = [0, 23, 24, 255, 256, 65535, 1, 2]
    assert PromptHasher(hasher).wire(ids) == _owner(hasher, ids)
    assert PromptHasher(hasher).wire([*ids, 65536, 2**40, 3, 4]) == _owner(hasher, [*ids, 65536, 2**40, 3, 4])


def test_ids_an_engine_refuses_give_nothing_to_reuse() -> None:
    fast = PromptHasher(BlockHasher(block_size=2))
    assert fast.wire([1, -2, 3, 4]) == []
    assert fast.wire([1]) == []


def test_the_router_hashes_long_prompts_off_its_event_loop() -> None:
    """A long prompt's work runs on the hashing thread, not on the loop that relays streams; a
    short one on the loop (the thread's wake-up would cost more)."""
    router = Router(RouterConfig(engines=(EngineSpec("e0", "http://127.0.0.1:9"),)), None, None)  # type: ignore[arg-type]
    seen: list[str] = []

    def work() -> list[BlockHash]:
        seen.append(threading.current_thread().name)
        return router.hashes(list(range(100)))

    try:
        hashes = asyncio.run(router.off_loop(work, OFF_LOOP_MIN_SIZE))
        assert asyncio.run(router.off_loop(work, OFF_LOOP_MIN_SIZE - 1)) == hashes
    finally:
        router.close()
    assert seen[0].startswith("router-hash") and seen[1] == threading.main_thread().name
    assert hashes == _owner(router.hasher, list(range(96)))  # every full block but the last token's
