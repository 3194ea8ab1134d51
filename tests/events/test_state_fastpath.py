"""CacheState's fast path (events.state_apply, events.state_tier) against a reference reducer
written the plain way: one BlockEntry per block, every event through validate_event. Both must
agree on results, violations (exact text), per-block entries and exports, for valid and invalid
input alike."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from events.schema import (
    MAX_HASH,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    LogRecord,
    SchemaError,
    validate_event,
)
from events.state import ApplyResult, BlockEntry, CacheState, Violation
from events.state_tier import TierView

Key = tuple[str, str, int]


class Reference:
    """The reducer's documented semantics, without any shortcut."""

    def __init__(self) -> None:
        self.offset = 0
        self.tiers: dict[Key, dict[int, BlockEntry]] = {}
        self.fences: dict[str, tuple[int, int]] = {}
        self.violations: list[Violation] = []

    def apply(self, r: LogRecord) -> ApplyResult:
        if r.offset <= self.offset:
            return ApplyResult.DUPLICATE
        if r.offset > self.offset + 1:
            self._v(r, "log_gap", f"expected offset {self.offset + 1}")
        self.offset = r.offset
        if r.incarnation != 0:
            known = self.fences.get(r.source)
            if known is not None and r.incarnation < known[0]:
                self._v(r, "stale_incarnation", f"incarnation {r.incarnation} < current {known[0]}")
                return ApplyResult.STALE
            if known is None or r.incarnation > known[0]:
                if known is not None:
                    for key in [k for k in self.tiers if k[0] == r.source]:
                        del self.tiers[key]
                if r.source_seq != 1:
                    self._v(r, "source_gap", f"incarnation {r.incarnation} starts at seq "
                                             f"{r.source_seq}, expected 1")  # fmt: skip
            elif r.source_seq <= known[1]:
                return ApplyResult.DUPLICATE
            elif r.source_seq > known[1] + 1:
                self._v(r, "source_gap",
                        f"seq {r.source_seq} after {known[1]} in incarnation {r.incarnation}")  # fmt: skip
            self.fences[r.source] = (r.incarnation, r.source_seq)
        for e in r.events:
            self._event(r, e)
        return ApplyResult.APPLIED

    def _event(self, r: LogRecord, e: Event) -> None:
        try:
            validate_event(e)
        except SchemaError as exc:
            self._v(r, "invalid_event", str(exc))
            return
        if isinstance(e, BlockStored):
            tier = self.tiers.setdefault((r.source, e.medium, e.group_idx), {})
            parent = e.parent_block_hash
            if e.medium == "GPU" and parent is not None and parent not in tier:
                self._v(r, "orphan_child", f"parent {parent} of {e.block_hashes[0]} not resident "
                                           f"in GPU group {e.group_idx}")  # fmt: skip
            bs = e.block_size
            for i, h in enumerate(e.block_hashes):
                tier[h] = BlockEntry(
                    parent, e.token_ids[i * bs : (i + 1) * bs], bs, e.kv_cache_spec_kind,
                    e.sliding_window, e.lora_name, None if e.extra_keys is None else e.extra_keys[i],
                )  # fmt: skip
                parent = h
        elif isinstance(e, BlockRemoved):
            tier = self.tiers.get((r.source, e.medium, e.group_idx), {})
            for h in e.block_hashes:
                if tier.pop(h, None) is None:
                    self._v(r, "unknown_block_removed",
                            f"{h} not resident in {e.medium} group {e.group_idx}")  # fmt: skip
        else:
            for key in [k for k in self.tiers if k[0] == r.source and e.medium in (None, k[1])]:
                del self.tiers[key]

    def _v(self, r: LogRecord, kind: str, detail: str) -> None:
        self.violations.append(Violation(r.offset, r.source, kind, detail))


_hash = st.integers(0, 9) | st.sampled_from((MAX_HASH, MAX_HASH + 1, -1))  # a few invalid
_medium = st.sampled_from(("GPU", "CPU", "TPU"))  # TPU: invalid
_group = st.sampled_from((0, 1, -1))


@st.composite
def _stored(draw: st.DrawFn) -> BlockStored:
    n = draw(st.integers(0, 4))  # 0: invalid
    bs = draw(st.sampled_from((1, 2, 0)))
    ntok = n * bs + draw(st.sampled_from((0, 0, 0, 1)))  # sometimes one token too many
    keys = draw(st.none() | st.lists(st.none() | st.tuples(st.integers(0, 3)),
                                     min_size=n, max_size=n + 1).map(tuple))  # fmt: skip
    kind = draw(st.sampled_from(("full_attention", "sliding_window")))
    return BlockStored(
        block_hashes=tuple(draw(st.lists(_hash, min_size=n, max_size=n))),  # repeats happen
        parent_block_hash=draw(st.none() | _hash),
        token_ids=tuple(range(100, 100 + ntok)),
        block_size=bs,
        medium=draw(_medium),  # type: ignore[arg-type]
        group_idx=draw(_group),
        kv_cache_spec_kind=kind,  # type: ignore[arg-type]
        sliding_window=4 if kind == "sliding_window" else None,
        lora_name=draw(st.sampled_from((None, "ad"))),
        extra_keys=keys,
    )


_event = (
    _stored()
    | st.builds(BlockRemoved, st.lists(_hash, max_size=4).map(tuple), _medium, _group)
    | st.builds(AllBlocksCleared, st.sampled_from((None, "GPU", "CPU", "TPU")))
)


@st.composite
def _records(draw: st.DrawFn) -> list[LogRecord]:
    out: list[LogRecord] = []
    offset = 0
    for _ in range(draw(st.integers(0, 20))):
        offset += draw(st.sampled_from((1, 1, 1, 2, 0)))  # gaps and duplicates
        out.append(LogRecord(
            offset, draw(st.sampled_from(("a", "b"))), draw(st.integers(0, 2)),
            draw(st.integers(1, 3)), 0.0, tuple(draw(st.lists(_event, max_size=4))),
        ))  # fmt: skip
    return out


@settings(max_examples=300)
@given(_records())
def test_fast_path_equals_reference(records: list[LogRecord]) -> None:
    state, ref = CacheState(), Reference()
    for r in records:
        assert state.apply(r) is ref.apply(r)
    assert state.violations == ref.violations
    assert state.offset == ref.offset
    assert {s: state.fence(s) for s in state.sources() if state.fence(s)} == ref.fences
    assert state.view() == {k: frozenset(t) for k, t in ref.tiers.items() if t}
    for (source, medium, group), tier in ref.tiers.items():
        view = state.blocks(source, medium, group)  # type: ignore[arg-type]
        assert dict(view) == tier and list(view) == list(tier)  # same entries, same order
        assert list(view.items()) == list(tier.items()) and len(view) == len(tier)
    snap = state.export()
    back = CacheState.from_snapshot(snap)
    assert back == state and back.export() == snap
    for src in snap.sources:
        for e in src.events:
            for h in e.block_hashes:
                ref_entry = ref.tiers[(src.source, e.medium, e.group_idx)][h]
                assert back.blocks(src.source, e.medium, e.group_idx)[h] == ref_entry


def test_a_hash_repeated_in_one_event_keeps_its_last_position() -> None:
    state = CacheState()
    state.apply(LogRecord(1, "a", 1, 1, 0.0, (BlockStored((5, 6, 5), 9, (1, 2, 3), 1, "CPU"),)))
    assert dict(state.blocks("a", "CPU")) == {
        5: BlockEntry(parent=6, token_ids=(3,), block_size=1),
        6: BlockEntry(parent=5, token_ids=(2,), block_size=1),
    }


def test_tier_view_is_a_live_read_only_mapping() -> None:
    state = CacheState()
    state.apply(LogRecord(1, "a", 0, 0, 0.0, (BlockStored((1, 2), None, (7, 8), 1, "GPU"),)))
    view = state.blocks("a", "GPU")
    assert isinstance(view, TierView)
    assert 2 in view and 3 not in view and len(view) == 2 and list(view) == [1, 2]
    assert view[2] == BlockEntry(1, (8,), 1) and view.get(3) is None
    assert view == {1: BlockEntry(None, (7,), 1), 2: BlockEntry(1, (8,), 1)}
    assert repr(view) == f"TierView({ {1: BlockEntry(None, (7,), 1), 2: BlockEntry(1, (8,), 1)}!r})"
    state.apply(LogRecord(2, "a", 0, 0, 0.0, (BlockRemoved((1,), "GPU"),)))
    assert list(view) == [2] and view[2].parent == 1  # live
    try:
        view[1]
    except KeyError as exc:
        assert exc.args == (1,)
    else:
        raise AssertionError("a removed block is still readable")
    assert not hasattr(view, "__setitem__")
