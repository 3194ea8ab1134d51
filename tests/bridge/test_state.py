"""LazyState: the bridge's state applied behind publishing, bounded by max_pending."""

from __future__ import annotations

from bridge.metrics import BridgeMetrics
from bridge.state import LazyState
from events.records import encode_record
from events.schema import BlockStored, LogRecord
from events.state import CacheState


def _records(n: int) -> list[LogRecord]:
    return [
        LogRecord(i, "e1", 1, i, 0.0, (BlockStored((i,), i - 1 if i > 1 else None, (i,), 1, "GPU"),))
        for i in range(1, n + 1)
    ]


def test_past_max_pending_each_new_record_applies_the_oldest() -> None:
    metrics = BridgeMetrics()
    lazy = LazyState(metrics, max_pending=3)
    records = _records(10)
    for n, r in enumerate(records, start=1):
        lazy.add((r.offset, encode_record(r)))
        assert lazy.pending == min(n, 3)
    assert lazy.catch_up(limit=2) == 2 and lazy.pending == 1
    assert metrics.registry.get_sample_value("kvbridge_pending_apply") == 1
    want = CacheState()
    for r in records:
        want.apply(r)
    assert lazy.export() == want.export() and lazy.pending == 0


def test_max_pending_zero_applies_inline_and_bad_entries_count_as_violations() -> None:
    metrics = BridgeMetrics()
    lazy = LazyState(metrics, max_pending=0)
    r1 = _records(1)[0]
    lazy.add((1, encode_record(r1)))
    lazy.add((2, b"\x01not a record"))
    lazy.add((3, encode_record(LogRecord(3, "e1", 1, 3, 0.0, (BlockStored((3,), 1, (3,), 1, "GPU"),)))))
    assert lazy.pending == 0
    # The undecodable entry, then the log gap and the seq gap it leaves behind.
    assert metrics.registry.get_sample_value("kvbridge_state_violations_total") == 3
    snap = lazy.export()
    assert snap.offset == 3 and [e.block_hashes for e in snap.sources[0].events] == [(1, 3)]


def _state(records: list[LogRecord]) -> CacheState:
    state = CacheState()
    for r in records:
        state.apply(r)
    return state


def test_start_from_a_checkpoint_then_the_tail() -> None:
    records = _records(10)
    lazy = LazyState(BridgeMetrics())
    lazy.add((1, encode_record(records[0])))  # queued before: dropped with the old state
    lazy.start_from(_state(records[:6]).export())
    for r in records[6:]:
        lazy.add((r.offset, encode_record(r)))
    assert lazy.is_ready and lazy.export() == _state(records).export()


def test_a_deferred_checkpoint_is_taken_at_its_offset() -> None:
    records = _records(10)
    lazy = LazyState(BridgeMetrics(), max_pending=0)
    lazy.defer_to(_state(records[:6]).export())
    for r in records[3:5]:  # before the checkpoint: it holds them, they are skipped
        lazy.add((r.offset, encode_record(r)))
        assert not lazy.is_ready
    lazy.add((6, encode_record(records[5])))
    assert lazy.is_ready and lazy.export() == _state(records[:6]).export()
    for r in records[6:]:
        lazy.add((r.offset, encode_record(r)))
    assert lazy.export() == _state(records).export()


def test_a_time_budget_ends_a_slice_after_at_least_one_record_in_order() -> None:
    lazy = LazyState(BridgeMetrics())
    records = _records(50)
    for r in records:
        lazy.add((r.offset, encode_record(r)))
    assert lazy.catch_up(budget_s=0.0) == 1 and lazy.pending == 49  # a zero budget still moves
    assert lazy.catch_up(limit=5, budget_s=60.0) == 5 and lazy.pending == 44
    while lazy.pending:
        assert lazy.catch_up(budget_s=0.0) == 1
    want = CacheState()
    for r in records:
        want.apply(r)
    assert lazy.export() == want.export()


def test_an_invalid_event_is_a_violation_and_the_rest_of_its_record_applies() -> None:
    """As in the daemon's recovery (the reducer checks each event): the bridge's state answers
    what the daemon's does for a record holding one invalid event."""
    metrics = BridgeMetrics()
    lazy = LazyState(metrics, max_pending=0)
    bad = BlockStored((2,), None, (2, 2), 1, "GPU")  # two token ids for one block of size 1
    record = LogRecord(1, "e1", 1, 1, 0.0, (BlockStored((1,), None, (1,), 1, "GPU"), bad))
    lazy.add((1, encode_record(record)))
    assert metrics.registry.get_sample_value("kvbridge_state_violations_total") == 1
    want = CacheState()
    want.apply(record)
    assert lazy.export() == want.export()
    assert [e.block_hashes for e in lazy.export().sources[0].events] == [(1,)]


def test_decoded_records_and_stored_entries_apply_alike() -> None:
    """The publisher queues records it decoded; the state is the one of their stored bytes."""
    records = _records(8)
    mixed, stored = LazyState(BridgeMetrics()), LazyState(BridgeMetrics())
    for r in records:
        mixed.add(r if r.offset % 2 else (r.offset, encode_record(r)))
        stored.add((r.offset, encode_record(r)))
    assert mixed.pending == 8 and mixed.export() == stored.export() == _state(records).export()
    deferred = LazyState(BridgeMetrics())
    deferred.defer_to(_state(records[:4]).export())
    for r in records[2:]:
        deferred.add(r)  # decoded records before the checkpoint's offset are skipped too
    assert deferred.export() == _state(records).export()
