"""The host-tier hit rule and the load plan (engine.offload.lookup): exact cases, no daemon
needed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.block_pool import NULL_BLOCK_ID
from engine.kv_cache import KVCacheGroup, KVCacheGroupSpec, first_visible_block
from engine.offload.copies import ArenaBlocks
from engine.offload.lookup import GroupHitInput, hit_length, lookup_keys, plan_load
from offloadd.arena import ArenaGeometry, ArenaMapping, create_chunk_file

BS = 16
WINDOW = 32  # two blocks


def _full(n: int) -> GroupHitInput:
    return GroupHitInput(None, n, tuple(range(n)))


def _sliding(present: set[int], num_keys: int) -> GroupHitInput:
    slots = tuple(10 + s if s in present else -1 for s in range(num_keys))
    return GroupHitInput(WINDOW, 0, slots)


def test_full_attention_only_takes_the_prefix() -> None:
    assert hit_length({0: _full(5)}, 8, 0, 0, 1, BS) == 5
    assert hit_length({0: _full(0)}, 8, 0, 0, 1, BS) == 0


def test_sliding_group_needs_only_the_window_at_the_end() -> None:
    # 8 blocks loaded: 128 tokens; the window then sees blocks 6 and 7 only.
    assert first_visible_block(8 * BS, WINDOW, BS) == 6
    assert hit_length({0: _full(8), 1: _sliding({6, 7}, 8)}, 8, 0, 0, 1, BS) == 8


def test_a_missing_window_block_shortens_the_hit() -> None:
    # Block 7 missing: 7 blocks (window = blocks 5, 6) still work.
    assert hit_length({0: _full(8), 1: _sliding({5, 6}, 8)}, 8, 0, 0, 1, BS) == 7
    # Nothing of the sliding group: no hit at all.
    assert hit_length({0: _full(8), 1: _sliding(set(), 8)}, 8, 0, 0, 1, BS) == 0


def test_window_blocks_inside_the_gpu_hit_are_not_needed() -> None:
    # GPU holds 7 blocks; loading block 7 needs the window blocks 6 (GPU) and 7 (key 0 here).
    first, keys = lookup_keys([bytes([i]) * 32 for i in range(8)], 7, 1)
    assert (first, len(keys)) == (7, 1)
    assert hit_length({0: _full(1), 1: _sliding({0}, 1)}, 1, first, 7, 1, BS) == 1


@pytest.mark.parametrize(("num_gpu_hit", "first", "num_keys"), [(0, 0, 3), (3, 1, 2), (4, 2, 1), (6, 3, 0)])
def test_keys_of_multi_block_offloads(num_gpu_hit: int, first: int, num_keys: int) -> None:
    digests = [bytes([i]) * 32 for i in range(7)]  # 7 engine blocks, k = 2: 3 complete ones
    got_first, keys = lookup_keys(digests, num_gpu_hit, 2)
    assert (got_first, len(keys)) == (first, num_keys)
    assert keys == tuple(digests[s * 2 + 1] for s in range(first, 3))


def test_multi_block_offload_with_a_window() -> None:
    # k=2, no GPU hit, 3 offloaded blocks = engine blocks 0..5; the window at 96 tokens covers
    # engine blocks 4 and 5 = offloaded block 2 only.
    assert hit_length({0: _full(3), 1: _sliding({2}, 3)}, 3, 0, 0, 2, BS) == 3


SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, tokens, heads, dim: one block of 512 bytes (float32)


@pytest.fixture
def full_group(tmp_path: Path) -> tuple[KVCacheGroup, dict[int, ArenaBlocks]]:
    geometry = ArenaGeometry(512, 16, 16, str(tmp_path / "chunk-{chunk}"))
    create_chunk_file(geometry.chunk_path(0), geometry.chunk_file_bytes, 0o600, None)
    arena = ArenaBlocks(ArenaMapping(geometry), SHAPE, torch.float32, torch.device("cpu"))
    group = KVCacheGroup(KVCacheGroupSpec(0, "full_attention", None, (0, 1)), torch.zeros(12, *SHAPE), 4)
    return group, {0: arena}


def test_plan_of_whole_engine_blocks(full_group: tuple[KVCacheGroup, dict[int, ArenaBlocks]]) -> None:
    # k = 1, every block loads: the lookup's slots from ``start`` on, as they are.
    group, arenas = full_group
    plan, used, nbytes = plan_load([group], arenas, 1, {0: (9, 4, 7, 2)}, 1, {0: [5, 6, 3, 99]}, 3)
    assert [(x.group_idx, list(x.block_ids), list(x.slots)) for x in plan] == [(0, [5, 6, 3], [4, 7, 2])]
    assert (used, nbytes) == ({0: {1, 2, 3}}, 3 * 512)


def test_plan_skips_null_blocks_and_maps_multi_block_offloads(
    full_group: tuple[KVCacheGroup, dict[int, ArenaBlocks]],
) -> None:
    group, arenas = full_group
    # k = 1 with a null block (outside the window): it is left out, its slot is not read.
    plan, used, nbytes = plan_load([group], arenas, 1, {0: (-1, 4, 7)}, 0, {0: [NULL_BLOCK_ID, 6, 3]}, 3)
    assert [(list(x.block_ids), list(x.slots)) for x in plan] == [([6, 3], [4, 7])]
    assert (used, nbytes) == ({0: {1, 2}}, 2 * 512)
    # k = 2: engine block p of the hit is row p % 2 of offloaded block p // 2 (slot s: 2s, 2s+1).
    plan, used, _ = plan_load([group], arenas, 2, {0: (3, 5)}, 1, {0: [8, 9, 10]}, 3)
    assert [(list(x.block_ids), list(x.slots)) for x in plan] == [([8, 9, 10], [7, 10, 11])]
    assert used == {0: {0, 1}}


@pytest.mark.parametrize(("k", "slots", "ids"), [(1, (4, -1), [5, 6]), (1, (4, -1), [NULL_BLOCK_ID, 6]),
                                                 (2, (-1,), [5, 6])])
def test_plan_refuses_a_block_the_lookup_did_not_find(
    full_group: tuple[KVCacheGroup, dict[int, ArenaBlocks]], k: int, slots: tuple[int, ...], ids: list[int],
) -> None:
    group, arenas = full_group
    with pytest.raises(RuntimeError, match="asked to load a block the lookup did not find"):
        plan_load([group], arenas, k, {0: slots}, 0, {0: ids}, 2)
    with pytest.raises(RuntimeError, match="1 block ids for a load of 2 blocks"):
        plan_load([group], arenas, k, {0: slots}, 0, {0: ids[:1]}, 2)
    with pytest.raises(IndexError):
        plan_load([group], arenas, k, {0: slots[:0]}, 0, {0: [5, 6]}, 2)
