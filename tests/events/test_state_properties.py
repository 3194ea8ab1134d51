"""CacheState under random operation sequences: snapshots restore equal states, and the view
matches a plain set model of the semantics."""

from __future__ import annotations

from collections.abc import Mapping

from hypothesis import given, settings
from hypothesis import strategies as st

from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, Event, LogRecord, Medium
from events.state import ApplyResult, BlockEntry, CacheState

# A small hash space so that removals hit, parents exist and chains branch.
_hash = st.integers(0, 12)
_medium: st.SearchStrategy[Medium] = st.sampled_from(("GPU", "CPU"))
_group = st.integers(0, 1)


@st.composite
def _stored(draw: st.DrawFn) -> BlockStored:
    n = draw(st.integers(1, 3))
    hashes = tuple(draw(st.lists(_hash, min_size=n, max_size=n)))
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=draw(st.none() | _hash),
        token_ids=tuple(range(n)),
        block_size=1,
        medium=draw(_medium),
        group_idx=draw(_group),
        lora_name=draw(st.sampled_from((None, "ad"))),  # splits chains on export
    )


_event = (
    _stored()
    | st.builds(BlockRemoved, st.lists(_hash, max_size=3).map(tuple), _medium, _group)
    | st.builds(AllBlocksCleared, st.none() | _medium)
)


@st.composite
def _records(draw: st.DrawFn) -> list[LogRecord]:
    out: list[LogRecord] = []
    for offset in range(1, draw(st.integers(0, 25)) + 1):
        out.append(
            LogRecord(
                offset=offset,
                source=draw(st.sampled_from(("a", "b"))),
                incarnation=draw(st.integers(0, 2)),
                source_seq=draw(st.integers(1, 4)),
                ts=0.0,
                events=tuple(draw(st.lists(_event, max_size=3))),
            )
        )
    return out


def _model(records: list[LogRecord]) -> dict[tuple[str, str, int], frozenset[int]]:
    """The semantics written as plainly as possible."""
    tiers: dict[tuple[str, str, int], set[int]] = {}
    fences: dict[str, tuple[int, int]] = {}
    for r in records:
        if r.incarnation:
            known = r.source in fences
            inc, seq = fences.get(r.source, (0, 0))
            if r.incarnation < inc or (r.incarnation == inc and r.source_seq <= seq):
                continue
            if known and r.incarnation > inc:  # first sight of a fence clears nothing
                for key in [k for k in tiers if k[0] == r.source]:
                    del tiers[key]
            fences[r.source] = (r.incarnation, r.source_seq)
        for e in r.events:
            if isinstance(e, BlockStored):
                tiers.setdefault((r.source, e.medium, e.group_idx), set()).update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                tiers.get((r.source, e.medium, e.group_idx), set()).difference_update(
                    e.block_hashes
                )
            else:
                for key in [k for k in tiers if k[0] == r.source]:
                    if e.medium in (None, key[1]):
                        del tiers[key]
    return {k: frozenset(v) for k, v in tiers.items() if v}


def _on_cycle(tier: Mapping[int, BlockEntry], start: int) -> bool:
    """Random hashes can make parent cycles, where no order puts every parent first: true when
    the chain of parents from ``start`` runs into a cycle (``start`` on it or hanging off it)."""
    seen: set[int] = {start}
    cur = tier[start].parent
    while cur is not None and cur in tier:
        if cur in seen:
            return True
        seen.add(cur)
        cur = tier[cur].parent
    return False


def _apply_all(records: list[LogRecord]) -> CacheState:
    state = CacheState()
    for record in records:
        state.apply(record)
    return state


@settings(max_examples=150)
@given(_records())
def test_view_matches_model_and_snapshot_round_trips(records: list[LogRecord]) -> None:
    state = _apply_all(records)
    assert state.view() == _model(records)
    assert state.counts() == {k: len(v) for k, v in _model(records).items()}
    snap = state.export()
    back = CacheState.from_snapshot(snap)
    assert back == state
    assert back.offset == state.offset == len(records)
    assert back.export() == snap
    # Parents come before any child that references them, per tier.
    for src in snap.sources:
        seen: set[tuple[str, int, int]] = set()
        for e in src.events:
            if e.parent_block_hash is not None:
                parent = (e.medium, e.group_idx, e.parent_block_hash)
                tier = state.blocks(src.source, e.medium, e.group_idx)
                resident = e.parent_block_hash in tier
                assert parent in seen or not resident or _on_cycle(tier, e.block_hashes[0])
            seen.update((e.medium, e.group_idx, h) for h in e.block_hashes)


@given(_records())
def test_reapplying_is_idempotent(records: list[LogRecord]) -> None:
    state = _apply_all(records)
    before = (state.view(), len(state.violations))
    assert all(state.apply(r) is ApplyResult.DUPLICATE for r in records)
    assert (state.view(), len(state.violations)) == before


def test_model_agrees_on_a_hand_checked_sequence() -> None:
    ev: list[Event] = [BlockStored((1, 2), None, (0, 1), 1, "GPU")]
    records = [LogRecord(1, "a", 1, 1, 0.0, tuple(ev))]
    assert _model(records) == _apply_all(records).view() == {("a", "GPU", 0): frozenset({1, 2})}
