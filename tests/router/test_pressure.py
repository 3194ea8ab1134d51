"""router.pressure: the GPU prefix expected at admission from the view, this router's finished
requests not yet in it, and the evictions its requests in flight will cause (LRU order)."""

from __future__ import annotations

from events.schema import BlockHash
from router.pressure import OVERLAY_S, Pressure


def _h(prefix: int, n: int) -> list[BlockHash]:
    return [BlockHash(prefix * 100 + i) for i in range(n)]


A, B, C, U = _h(1, 4), _h(2, 4), _h(3, 3), _h(4, 3)


def _released(p: Pressure, rid: str, hashes: list[BlockHash], gpu: set[BlockHash]) -> None:
    """A request that computed ``hashes`` on the engine, finished, and whose events arrived."""
    p.started(rid, hashes, 0)
    p.finished(rid, now=0.0)
    gpu.update(hashes)


def test_without_a_pool_size_the_view_is_taken_as_is() -> None:
    p = Pressure()
    p.started("c", C, 0)
    assert p.surviving(set(A), A, 4, now=1.0) == 4


def test_the_oldest_released_blocks_go_first_tail_first() -> None:
    """Pool 10: A then B released (8 cached), C in flight needs 3 blocks, one is free: 2 evictions,
    A's last two blocks (a request frees its tail first)."""
    p, gpu = Pressure(pool_blocks=10), set[BlockHash]()
    _released(p, "a", A, gpu)
    _released(p, "b", B, gpu)
    p.started("c", C, 0)
    assert p.surviving(gpu, A, 4, now=1.0) == 2
    assert p.surviving(gpu, B, 4, now=1.0) == 4
    gpu.difference_update(A[2:])  # the engine's events arrive: A's tail evicted, C stored
    gpu.update(C)
    assert p.surviving(gpu, A, 2, now=1.0) == 2
    assert p.num_pending == 1  # C, reflected, still in flight: in use, no demand


def test_blocks_in_use_are_never_evicted() -> None:
    p, gpu = Pressure(pool_blocks=10), set[BlockHash]()
    _released(p, "a", A, gpu)
    _released(p, "b", B, gpu)
    p.started("a2", A, 4)  # A again, all cached: its blocks are in use now
    p.started("c", C, 0)
    assert p.surviving(gpu, A, 4, now=1.0) == 4
    assert p.surviving(gpu, B, 4, now=1.0) == 1  # the evictions fall on B instead


def test_blocks_never_seen_used_go_before_released_ones() -> None:
    p, gpu = Pressure(pool_blocks=10), set(U)
    _released(p, "a", A, gpu)
    p.started("c", C, 0)  # 3 + 1 in flight - (10 - 7) free: 1 eviction, one of U's
    assert p.surviving(gpu, A, 4, now=1.0) == 4
    p.started("d", _h(5, 3), 0)  # 3 more, one more in flight: 5 evictions, U all and 2 of A
    assert p.surviving(gpu, A, 4, now=1.0) == 2


def test_finished_blocks_count_before_their_events_arrive() -> None:
    p, gpu = Pressure(pool_blocks=64), set(A[:2])
    p.started("a", A, 2)
    p.finished("a", now=10.0)
    assert p.surviving(gpu, [*A, *B], 2, now=10.1) == 4  # the overlay: A[2:] are stored by now
    assert p.surviving(gpu, [*A, *B], 2, now=10.0 + OVERLAY_S + 1) == 2  # they never came: forgotten
    assert p.num_pending == 0


def test_a_prefilled_request_counts_before_its_events_arrive() -> None:
    """Its first token came: every prompt block is cached on the engine, in use until it ends."""
    p, gpu = Pressure(pool_blocks=64), set[BlockHash]()
    p.started("a", A, 0)
    assert p.surviving(gpu, [*A, *B], 0, now=1.0) == 0
    p.prefilled("a")
    assert p.surviving(gpu, [*A, *B], 0, now=1.0) == 4


def test_a_block_two_requests_compute_is_computed_once() -> None:
    """Two requests on the engine with the same new blocks: the engine computes them once."""
    p, gpu = Pressure(pool_blocks=10), set[BlockHash]()
    _released(p, "a", A, gpu)
    _released(p, "b", B, gpu)
    p.started("c1", C, 0)
    p.started("c2", C, 0)  # 3 new blocks, 2 requests in flight, 0 free: 3 evictions
    assert p.surviving(gpu, A, 4, now=1.0) == 1


def test_a_request_is_caught_up_once_its_last_block_was_stored_even_if_evicted_since() -> None:
    """Its blocks came and went before the decision: its demand is in the view already."""
    p, gpu = Pressure(pool_blocks=10), set[BlockHash]()
    _released(p, "a", A, gpu)
    _released(p, "b", B, gpu)
    p.started("c", C, 0)
    p.finished("c", now=1.0)
    assert p.surviving(gpu, A, 4, now=1.1) < 4  # C's 3 blocks still to come, as far as the view says
    p.saw_stored(C)  # the stream stored them (and, say, evicted them again)
    assert p.surviving(gpu, A, 4, now=1.1) == 4
    assert p.num_pending == 0


def test_blocks_seen_stored_count_for_the_truth_even_when_evicted_since() -> None:
    p = Pressure(pool_blocks=10)
    p.saw_stored(A)
    assert p.stored_run(set(), [*A, *B]) == 4  # evicted again: not a hash mismatch
    assert p.stored_run(set(B), [*B, *A]) == 8
    assert p.stored_run(set(), B) == 0


def test_records_do_not_grow_without_a_view() -> None:
    """No pool size and no events (another engine kind, or no bridge): finished requests are
    forgotten after the overlay time, not kept for ever."""
    p = Pressure()
    for i in range(100):
        p.started(f"r{i}", _h(10 + i, 3), 0)
        p.finished(f"r{i}", now=2.0 * i * OVERLAY_S)
    assert p.num_pending == 1

