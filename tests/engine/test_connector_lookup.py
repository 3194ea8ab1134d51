"""The host-tier hit rule (engine.offload.lookup): exact cases, no daemon needed."""

from __future__ import annotations

import pytest

from engine.kv_cache import first_visible_block
from engine.offload.lookup import GroupHitInput, hit_length, lookup_keys

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
