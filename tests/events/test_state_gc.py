"""events.state_gc.GcPolicy: frozen after every chunk, cyclic garbage reclaimed by the periodic
full collection."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from events.state_gc import GcPolicy


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()


def test_after_a_chunk_the_survivors_are_frozen() -> None:
    gc.unfreeze()
    kept = [_Node() for _ in range(100)]
    policy = GcPolicy(full_interval_s=3600.0)
    policy.after_chunk()
    assert gc.get_freeze_count() >= len(kept) and policy.num_full == 0


def test_the_full_collection_frees_frozen_cyclic_garbage() -> None:
    node = _Node()
    ref = weakref.ref(node)
    GcPolicy(full_interval_s=3600.0).after_chunk()
    del node
    gc.collect()
    assert ref() is not None  # frozen: an ordinary collection does not see it
    policy = GcPolicy(full_interval_s=0.0)
    policy.after_chunk()
    assert ref() is None and policy.num_full == 1 and gc.get_freeze_count() > 0
