"""Router.hashes: the owner's (events.hashing) wire hashes of the blocks an engine can reuse."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator

import pytest

from events.hashing import HASH_ALGOS, BlockHasher, HashAlgo, to_wire
from events.schema import BlockHash
from router.config import EngineSpec, RouterConfig
from router.service import OFF_LOOP_MIN_SIZE, Router


def _owner(hasher: BlockHasher, ids: list[int]) -> list[int]:
    return [to_wire(d) for d in hasher.hash_blocks_general(ids)]


@pytest.fixture
def router() -> Iterator[Router]:
    r = Router(RouterConfig(engines=(EngineSpec("e0", "http://127.0.0.1:9"),), block_size=4), None, None)  # type: ignore[arg-type]
    yield r
    r.close()


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_every_full_block_but_the_last_tokens(algo: HashAlgo) -> None:
    """Every CBOR width of an id, on and off the fast path; the block holding the last token
    is never one an engine reuses."""
    rng = random.Random(algo)
    router = Router(RouterConfig(engines=(EngineSpec("e0", "http://127.0.0.1:9"),), block_size=16, hash_algo=algo),
                    None, None)  # type: ignore[arg-type]
    try:
        ranges = [(0, 24), (24, 256), (256, 1 << 16), (1 << 16, 1 << 20), (1 << 40, 1 << 41)]
        for trial in range(20):
            picks = ranges if trial % 4 == 0 else ranges[:4]
            ids = [rng.randrange(*rng.choice(picks)) for _ in range(rng.randrange(1, 200))]
            n = (len(ids) - 1) // 16
            assert router.hashes(ids) == _owner(router.hasher, ids[: n * 16])
        assert router.hashes(list(range(32))) == _owner(router.hasher, list(range(16)))
    finally:
        router.close()


def test_ids_an_engine_refuses_give_nothing_to_reuse(router: Router) -> None:
    assert router.hashes([1, -2, 3, 4, 5, 6, 7, 8, 9]) == []
    assert router.hashes([1, 2, 3, 4]) == []  # one block, holding the last token
    assert router.hashes([]) == []


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
