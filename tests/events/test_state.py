"""CacheState scenarios with exact expected states."""

from __future__ import annotations

import time

import pytest

from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, Event, LogRecord, SchemaError
from events.state import (
    ApplyResult,
    BlockEntry,
    CacheState,
    PrefixMatch,
    Snapshot,
    SourceSnapshot,
    Violation,
)


def stored(
    hashes: list[int], parent: int | None, medium: str = "GPU", group: int = 0
) -> BlockStored:
    tokens = tuple(t for h in hashes for t in (h * 10, h * 10 + 1))  # block_size 2
    return BlockStored(tuple(hashes), parent, tokens, 2, medium, group)  # type: ignore[arg-type]


class Log:
    """Builds records with contiguous offsets and per-source seqs."""

    def __init__(self) -> None:
        self.offset = 0
        self.seqs: dict[tuple[str, int], int] = {}

    def rec(self, source: str, *events: Event, inc: int = 1, seq: int | None = None) -> LogRecord:
        self.offset += 1
        if seq is None:
            seq = self.seqs.get((source, inc), 0) + 1
        self.seqs[(source, inc)] = seq
        return LogRecord(self.offset, source, inc, seq, 100.0 + self.offset, tuple(events))


def test_store_chain_then_remove_and_clear_per_medium() -> None:
    log, st = Log(), CacheState()
    assert st.apply(log.rec("e1", stored([1, 2, 3], None))) is ApplyResult.APPLIED
    assert st.apply(log.rec("e1", stored([2, 3], 1, "CPU"), stored([9], None, group=1)))
    assert st.view() == {
        ("e1", "GPU", 0): frozenset({1, 2, 3}),
        ("e1", "CPU", 0): frozenset({2, 3}),
        ("e1", "GPU", 1): frozenset({9}),
    }
    assert st.blocks("e1", "GPU")[2] == BlockEntry(parent=1, token_ids=(20, 21), block_size=2)
    assert st.blocks("e1", "CPU")[2].parent == 1  # CPU tier may lack the parent: no violation
    assert st.has("e1", "GPU", 9, group_idx=1) and not st.has("e1", "GPU", 9)

    st.apply(log.rec("e1", BlockRemoved((3,), "GPU")))
    st.apply(log.rec("e1", AllBlocksCleared("CPU")))
    assert st.counts() == {("e1", "GPU", 0): 2, ("e1", "GPU", 1): 1}
    st.apply(log.rec("e1", AllBlocksCleared()))
    assert st.counts() == {} and st.view() == {}
    assert st.sources() == ["e1"] and st.fence("e1") == (1, 5)
    assert st.offset == 5 and st.violations == []
    assert dict(st.blocks("e1", "GPU")) == {} and dict(st.blocks("nobody", "CPU")) == {}


def test_restoring_a_present_hash_updates_it() -> None:
    log, st = Log(), CacheState()
    st.apply(log.rec("e1", stored([1], None)))
    st.apply(log.rec("e1", BlockStored((1,), None, (7, 8), 2, "GPU", lora_name="ad")))
    assert st.blocks("e1", "GPU")[1] == BlockEntry(None, (7, 8), 2, lora_name="ad")
    assert st.violations == []


def test_duplicates_gaps_new_incarnation_and_stale() -> None:
    log, st = Log(), CacheState()
    r1 = log.rec("e1", stored([1], None))
    assert st.apply(r1) is ApplyResult.APPLIED
    assert st.apply(r1) is ApplyResult.DUPLICATE  # same offset
    # A new offset repeating seq 1 (the engine resent): duplicate by source fence.
    assert st.apply(log.rec("e1", stored([2], 1), seq=1)) is ApplyResult.DUPLICATE
    assert st.view() == {("e1", "GPU", 0): frozenset({1})}
    # A seq gap is recorded, then applied.
    assert st.apply(log.rec("e1", stored([3], 1), seq=4)) is ApplyResult.APPLIED
    # A log gap (offset 4 -> 6) is recorded, then applied.
    log.offset += 1
    assert st.apply(log.rec("e1", stored([4], 3))) is ApplyResult.APPLIED
    assert st.fence("e1") == (1, 5)
    # A new incarnation clears every tier of the source first.
    st.apply(log.rec("e2", stored([50], None, "CPU")))
    r_new = log.rec("e1", stored([7], None), inc=2, seq=2)
    assert st.apply(r_new) is ApplyResult.APPLIED
    assert st.view() == {("e1", "GPU", 0): frozenset({7}), ("e2", "CPU", 0): frozenset({50})}
    # The old incarnation is fenced out.
    assert st.apply(log.rec("e1", stored([8], None), inc=1, seq=6)) is ApplyResult.STALE
    assert st.fence("e1") == (2, 2) and st.offset == 8
    assert st.violations == [
        Violation(3, "e1", "source_gap", "seq 4 after 1 in incarnation 1"),
        Violation(5, "e1", "log_gap", "expected offset 4"),
        Violation(7, "e1", "source_gap", "incarnation 2 starts at seq 2, expected 1"),
        Violation(8, "e1", "stale_incarnation", "incarnation 1 < current 2"),
    ]


def test_incarnation_zero_is_unfenced() -> None:
    log, st = Log(), CacheState()
    st.apply(log.rec("zmq", stored([1], None), inc=0, seq=0))
    st.apply(log.rec("zmq", stored([2], 1), inc=0, seq=0))
    assert st.fence("zmq") is None and st.sources() == ["zmq"]
    assert st.counts() == {("zmq", "GPU", 0): 2} and st.violations == []


def test_unknown_removal_orphan_and_invalid_are_recorded_not_raised() -> None:
    log, st = Log(), CacheState()
    st.apply(log.rec("e1", stored([1], None)))
    bad = BlockStored((5,), None, (1,), 2, "GPU")  # 1 token for a block of 2
    result = st.apply(
        log.rec(
            "e1",
            BlockRemoved((1, 42), "GPU"),
            stored([10, 11], 99),  # GPU parent 99 not resident: orphan (first block only)
            stored([20], 99, "CPU"),  # CPU: legitimate
            bad,
            BlockRemoved((1,), "CPU", 3),
        )
    )
    assert result is ApplyResult.APPLIED
    assert st.view() == {("e1", "GPU", 0): frozenset({10, 11}), ("e1", "CPU", 0): frozenset({20})}
    assert [(v.offset, v.kind) for v in st.violations] == [
        (2, "unknown_block_removed"),
        (2, "orphan_child"),
        (2, "invalid_event"),
        (2, "unknown_block_removed"),
    ]
    assert st.violations[0].detail == "42 not resident in GPU group 0"
    assert st.violations[1].detail == "parent 99 of 10 not resident in GPU group 0"
    assert st.violations[2].detail.startswith("BlockStored.token_ids: expected 2 ids")
    assert st.violations[3].detail == "1 not resident in CPU group 3"


def test_longest_prefix_with_gpu_and_cpu_weights() -> None:
    log, st = Log(), CacheState()
    st.apply(log.rec("a", stored([1, 2], None), stored([1, 2, 3, 4], None, "CPU")))
    st.apply(log.rec("b", stored([1, 2, 3], None, "CPU")))
    st.apply(log.rec("c", stored([2, 3], None)))  # lacks block 1: no match
    st.apply(log.rec("d", stored([1, 2, 3, 4, 5], None, group=1)))
    got = st.longest_prefix([1, 2, 3, 4, 5])
    assert got == {
        "a": PrefixMatch(num_blocks=4, num_gpu=2, num_cpu=2, score=1.0 + 1.0 + 0.8 + 0.8),
        "b": PrefixMatch(num_blocks=3, num_gpu=0, num_cpu=3, score=0.8 + 0.8 + 0.8),
    }
    assert st.longest_prefix([1, 2], weights={"GPU": 0.5, "CPU": 1.0})["a"] == PrefixMatch(
        2, 0, 2, 2.0
    )
    assert st.longest_prefix([1], group_idx=1) == {"d": PrefixMatch(1, 1, 0, 1.0)}
    assert st.longest_prefix([]) == {}


def test_export_lists_parents_first_and_restores_equal() -> None:
    log, st = Log(), CacheState()
    # A tree: 1 -> 2 -> 3 and 2 -> 4; a second root 7; a CPU block whose parent is absent.
    st.apply(log.rec("e1", stored([1, 2, 3], None), stored([4], 2), stored([7], None)))
    st.apply(log.rec("e1", stored([30], 3, "CPU")))
    st.apply(log.rec("e2", AllBlocksCleared()))
    snap = st.export()
    assert snap.offset == 3
    assert [s.source for s in snap.sources] == ["e1", "e2"]
    e1 = snap.sources[0]
    assert (e1.incarnation, e1.last_seq) == (1, 2)
    assert [(e.medium, e.block_hashes, e.parent_block_hash) for e in e1.events] == [
        ("GPU", (1, 2, 3), None),
        ("GPU", (4,), 2),
        ("GPU", (7,), None),
        ("CPU", (30,), 3),
    ]
    assert e1.events[0].token_ids == (10, 11, 20, 21, 30, 31)
    assert snap.sources[1] == SourceSnapshot("e2", 1, 1, ())
    back = CacheState.from_snapshot(snap)
    assert back == st and back.offset == 3 and back.violations == []
    assert back.blocks("e1", "GPU") == st.blocks("e1", "GPU")
    assert back.export() == snap


def test_export_splits_chains_of_different_kinds_and_survives_cycles() -> None:
    log, st = Log(), CacheState()
    st.apply(
        log.rec(
            "e1",
            stored([1], None),
            BlockStored((2,), 1, (5,), 1, "GPU"),  # other block size: its own event
            BlockStored((3,), 4, (1, 1), 2, "GPU"),  # 3 <- 4 <- 3: a corrupt cycle
            BlockStored((4,), 3, (2, 2), 2, "GPU"),
        )
    )
    events = st.export().sources[0].events
    assert [(e.block_hashes, e.parent_block_hash) for e in events] == [
        ((1,), None),
        ((2,), 1),
        ((3, 4), 4),
    ]
    assert CacheState.from_snapshot(st.export()) == st


def test_equality_needs_same_fences() -> None:
    a, b = CacheState(), CacheState()
    a.apply(LogRecord(1, "e1", 1, 1, 0.0, ()))
    b.apply(LogRecord(1, "e1", 2, 1, 0.0, ()))
    assert a != b and a == CacheState.from_snapshot(a.export())
    assert a != "not a state"
    assert CacheState.from_snapshot(Snapshot(0, ())) == CacheState()


def test_apply_100k_blocks_well_under_a_second() -> None:
    records, parent = [], None
    for i in range(1000):
        hashes = tuple(range(i * 100 + 1, i * 100 + 101))
        ev = BlockStored(hashes, parent, tuple(range(1600)), 16, "GPU")
        records.append(LogRecord(i + 1, "e1", 1, i + 1, 0.0, (ev,)))
        parent = hashes[-1]
    st = CacheState()
    start = time.perf_counter()
    for record in records:
        st.apply(record)
    elapsed = time.perf_counter() - start
    assert st.counts() == {("e1", "GPU", 0): 100_000} and st.violations == []
    assert elapsed < 0.8, f"applying 100k blocks took {elapsed:.3f}s"


def test_restore_replaces_the_state_in_place_and_keeps_the_violations() -> None:
    state = CacheState()
    state.apply(LogRecord(1, "a", 1, 1, 0.0, (BlockRemoved((9,), "GPU"),)))  # a violation
    other = CacheState()
    other.apply(LogRecord(1, "b", 4, 7, 0.0, (BlockStored((5, 6), None, (1, 2, 3, 4), 2, "CPU"),)))
    snap = other.export()
    held = state
    state.restore(snap)
    assert held is state and state == other and state.offset == 1 and state.fence("b") == (4, 7)
    assert [v.kind for v in state.violations] == ["unknown_block_removed"]
    bad = Snapshot(3, (SourceSnapshot("c", 1, 1, (BlockStored((1,), None, (1,), 2, "GPU"),)),))
    with pytest.raises(SchemaError):
        state.restore(bad)  # one token for a block of two
    assert state == other and state.offset == 1


def test_changes_other_than_appends_are_recorded_only_while_tracked() -> None:
    log, state = Log(), CacheState()
    state.apply(log.rec("e", stored([1, 2, 3], None), stored([7], None, "CPU")))
    state.apply(log.rec("e", BlockRemoved((2,), "GPU")))
    assert state.take_changes() == {}  # not tracked: nothing kept
    state.track_changes()
    state.apply(log.rec("e", stored([4], 3)))  # an append: not a change
    state.apply(log.rec("e", BlockRemoved((1,), "GPU"), stored([3], None), stored([5, 3], 4)))
    state.apply(log.rec("e", BlockRemoved((9,), "GPU", 1)))  # a tier that does not exist
    got = state.take_changes()
    gpu = got[("e", "GPU", 0)]
    assert (gpu.removed, gpu.rewritten, gpu.reset) == ([1], [3, 5, 3], False)
    assert list(got) == [("e", "GPU", 0)] and state.take_changes() == {}  # taken: forgotten
    state.apply(log.rec("e", AllBlocksCleared("CPU"), BlockRemoved((4,), "GPU")))
    state.apply(log.rec("f", stored([1], None)))  # a new source, tracked from its first record
    state.apply(log.rec("f", BlockRemoved((1,), "GPU")))
    got = state.take_changes()
    assert got[("e", "CPU", 0)].reset and got[("e", "GPU", 0)].removed == [4]
    assert got[("f", "GPU", 0)].removed == [1]
    state.apply(log.rec("e", stored([8], None), inc=2))  # a new incarnation replaces its tiers
    assert state.take_changes()[("e", "GPU", 0)].reset
    state.restore(Snapshot(0, ()))  # every tier replaced, an emptied one too
    assert {t for t, c in state.take_changes().items() if c.reset} == {("e", "GPU", 0), ("f", "GPU", 0)}
