"""kvctl.seek (what kvctl web's endpoints compute) against the reducer applied from the start."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from events.schema import LogRecord
from events.state import CacheState
from kvctl.errors import KvctlError
from kvctl.seek import SeekableLog
from tests.support.bridge_proc import FleetSimulator


def _log(n: int) -> list[LogRecord]:
    sim = FleetSimulator(["engine-a", "engine-b", "offloadd"], seed=21)
    return [LogRecord(offset, source, 1, seq, 1000.0 + offset, tuple(events))
            for offset, (source, events, seq) in enumerate(sim.records(n), start=1)]


def _replayed(records: list[LogRecord], at: int) -> CacheState:
    state = CacheState()
    for r in records:
        if r.offset <= at:
            state.apply(r)
    return state


@pytest.mark.parametrize("keep_every", [None, 1, 7])
def test_every_offset_is_the_reducers_state(keep_every: int | None) -> None:
    records = _log(150)
    log = SeekableLog(CacheState(), iter(records), keep_every)
    assert (log.start, log.last, len(log.records)) == (0, 150, 150)
    assert log.num_kept == (1 if keep_every is None else 1 + 150 // keep_every)
    for at in [*range(0, 151, 3), 150, 73, 0, 150]:  # out of order, and again
        assert log.state_at(at) == _replayed(records, at), at
    body = log.state_json(90)
    state = _replayed(records, 90)
    assert {(s["source"], t["medium"], t["group_idx"]): t["blocks"]
            for s in body["sources"] for t in s["tiers"]} == state.counts()
    assert body["record"]["offset"] == 90 and body["record"]["source"] == records[89].source
    assert body["totals"]["GPU"] == sum(n for (_, m, _), n in state.counts().items() if m == "GPU")
    chains = {(s["source"], t["medium"], t["group_idx"]): t["chains"]
              for s in body["sources"] for t in s["tiers"]}
    exported: dict[tuple[str, str, int], int] = {}
    for src in state.export().sources:
        for e in src.events:
            key = (src.source, e.medium, e.group_idx)
            exported[key] = exported.get(key, 0) + 1
    assert chains == exported
    quick = log.state_json(90, with_chains=False)  # what the page asks first
    assert [t["chains"] for s in quick["sources"] for t in s["tiers"]] == [None] * len(chains)
    assert quick["totals"] == body["totals"] and "chains" not in quick


def test_diff_is_the_set_difference_of_two_states() -> None:
    records = _log(120)
    log = SeekableLog(CacheState(), iter(records))
    before, after = _replayed(records, 30).view(), _replayed(records, 110).view()
    got = {(c["source"], c["medium"], c["group_idx"]): (c["added"], c["removed"])
           for c in log.diff_json(30, 110)["changes"]}
    want = {k: (len(after.get(k, set()) - before.get(k, set())),
                len(before.get(k, set()) - after.get(k, set()))) for k in before.keys() | after.keys()}
    assert got == {k: v for k, v in want.items() if v != (0, 0)}
    assert any(removed for _, removed in got.values())
    with pytest.raises(KvctlError, match=r"^A \(110\) must not be after B \(30\)$"):
        log.diff_json(110, 30)
    with pytest.raises(KvctlError, match=r"^offset 121 is beyond the end of the log"):
        log.state_at(121)


def test_a_log_with_a_gap_resumes_from_the_state_restored_there() -> None:
    """As kvctl.logsource hands over an archive whose middle was trimmed: records 1..60, the
    state restored in place to the checkpoint at 90, then records 91..120."""
    records = _log(120)
    at_90 = _replayed(records, 90).export()
    state = CacheState()

    def with_gap() -> Iterator[LogRecord]:
        yield from records[:60]
        state.restore(at_90)
        yield from records[90:]

    log = SeekableLog(state, with_gap(), keep_every=25)
    for at in (0, 30, 59, 60, 90, 91, 105, 120):
        assert log.state_at(at) == _replayed(records, at), at
    with pytest.raises(KvctlError, match=r"^offset 75 is in a gap of the log \(offsets 61\.\.89 "
                                         r"are missing\): states are known at offset 60 and "
                                         r"from offset 90 on$"):
        log.state_at(75)
