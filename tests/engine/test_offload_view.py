"""The engine's view of the host tier: where its blocks sit (engine.offload.view)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from engine.offload.view import SpeculativeLoad, TierView, leading, vouched
from offloadd.client import GroupQuery


def _keys(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + bytes([i]) * 31 for i in range(n)]


def test_learn_find_and_forget() -> None:
    view = TierView()
    keys = _keys(4)
    view.learn(0, keys, [7, 8, 9, 10], [101, 102, 103, 104])
    assert view.find(0, keys) == ([7, 8, 9, 10], [101, 102, 103, 104])
    assert view.find(1, keys) == ([-1] * 4, [0] * 4)  # groups are apart
    # An answer that no longer holds a key (-1), or holds it elsewhere, replaces what was known.
    view.learn(0, keys[:2], [-1, 20], [0, 205])
    assert view.find(0, keys) == ([-1, 20, 9, 10], [0, 205, 103, 104])
    # A daemon that sends no generation (0) teaches nothing.
    view.learn(0, keys[2:3], [9], [0])
    assert view.find(0, keys[2:3]) == ([-1], [0])
    assert len(view) == 2
    view.clear()
    assert len(view) == 0 and view.find(0, keys)[0] == [-1] * 4
    view.clear(capacity=2)  # a registration bounds it by the daemon's slots
    view.learn(0, keys, [1, 2, 3, 4], [1, 1, 1, 1])
    assert view.capacity == 2 and view.find(0, keys)[0] == [-1, -1, 3, 4]


def test_the_least_recently_learned_go_first() -> None:
    view = TierView(capacity=4)
    a, b = _keys(3, b"a"), _keys(3, b"b")
    view.learn(0, a, [1, 2, 3], [1, 1, 1])
    view.find(0, a[1:])  # finding renews nothing (a hit's path)...
    view.learn(0, a[:1], [1], [1])  # ...the answer to the hit's report does
    view.learn(1, b[:2], [4, 5], [1, 1])
    assert len(view) == 4
    slots, _ = view.find(0, a)
    assert slots[0] == 1 and slots.count(-1) == 1  # one of a[1:], not a[0], went


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        TierView(capacity=0)
    with pytest.raises(ValueError, match="capacity"):
        TierView().clear(capacity=-1)
    with pytest.raises(ValueError, match="2 keys, 1 slots, 2 generations"):
        TierView().learn(0, _keys(2), [1], [1, 2])


def test_learning_from_another_thread_while_finding() -> None:
    view = TierView(capacity=1000)
    keys = _keys(200)
    view.learn(0, keys, list(range(200)), [1] * 200)
    stop = threading.Event()

    def learn() -> None:
        i = 0
        while not stop.is_set():
            view.learn(0, keys, list(range(i, i + 200)), [i + 1] * 200)
            i += 1

    t = threading.Thread(target=learn)
    t.start()
    try:
        for _ in range(200):
            slots, gens = view.find(0, keys)
            # One learn is seen whole or not at all: every key from the same answer.
            assert len(set(gens)) == 1 and [s - slots[0] for s in slots] == list(range(200))
    finally:
        stop.set()
        t.join()


def test_the_table_vouches_for_a_slot_only_with_its_generation() -> None:
    table = np.zeros(8, dtype=np.uint64)
    table[[4, 6]] = [40, 2**63 + 1]
    # unknown (-1), outside the table, given again (another generation), out of service (0):
    got = vouched(table, [4, -1, 6, 99, 6, 5], [40, 0, 2**63 + 1, 1, 61, 50])
    assert got == [4, -1, 6, -1, -1, -1]
    assert vouched(table, [], []) == []


def test_a_load_from_the_view_holds_only_while_every_slot_read_shows_its_generation() -> None:
    keys = tuple(_keys(3))
    load = SpeculativeLoad("r", [GroupQuery(0, keys)], {0: ([4, 5, 6], [40, 50, 60]),
                                                        1: ([7, -1, 9], [70, 0, 90])})
    load.used = {0: {0, 1, 2}, 1: {2}}  # the sliding group read only the block in its window
    tables = {0: np.zeros(10, dtype=np.uint64), 1: np.zeros(10, dtype=np.uint64)}
    tables[0][[4, 5, 6]] = [40, 50, 60]
    tables[1][9] = 90
    assert load.still_valid(tables)
    tables[1][7] = 71  # a slot the load did not read may change
    assert load.still_valid(tables)
    # A slot given again meanwhile (a new generation), or taken out of service (0):
    for gi, slot, value in ((0, 5, 51), (0, 6, 0), (1, 9, 0)):
        before = tables[gi][slot]
        tables[gi][slot] = value
        assert not load.still_valid(tables)
        tables[gi][slot] = before
    assert not load.still_valid({0: tables[0]})  # no table for a group it read


def test_leading() -> None:
    assert (leading([3, 4, -1, 5]), leading([]), leading([-1]), leading([1, 2])) == (2, 0, 0, 2)
