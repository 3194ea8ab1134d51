"""Recovery's choice of which projection rows to restore (offloadd.log.recovery._slot_entries):
the bulk path for a clean projection and the row-by-row path agree, and rows the log does not
hold, slots out of range and a slot claimed twice are refused."""

from __future__ import annotations

from collections.abc import Callable

from offloadd.log.projection import ProjectedBlock, decode_entry, encode
from offloadd.log.recovery import _slot_entries, _slot_entries_checked
from offloadd.tier.index import BlockState, SlotEntry


def _digest(i: int) -> bytes:
    return bytes(24) + i.to_bytes(8, "big")  # wire hash = the last 8 bytes = i


def _generations(after: int = 0) -> Callable[[int], range]:
    """DaemonSource.next_generations over a counter that starts after ``after``."""
    last = [after]

    def take(n: int) -> range:
        last[0] += n
        return range(last[0] - n + 1, last[0] + 1)

    return take


def _row(slot: int) -> SlotEntry:
    """A projection row as recovery reads it (offloadd.log.log_reads.read_rows)."""
    return decode_entry(encode(ProjectedBlock(slot, 0, 1000 + slot, None, (slot, slot + 1), b"", None)))


def test_clean_projection_restores_every_row_in_bulk() -> None:
    rows = {_digest(i): _row(i) for i in range(1, 6)}
    take = _generations(after=6)
    entries, wires, refused = _slot_entries(rows, {1, 2, 3, 4, 5, 99}, 8, take)
    assert refused == []
    assert wires == {1, 2, 3, 4, 5}
    assert [e.slot for e in entries.values()] == [1, 2, 3, 4, 5]
    assert [e.generation for e in entries.values()] == [7, 8, 9, 10, 11]
    first = entries[_digest(1)]
    assert (first.state, first.verified, first.checksum, first.token_ids) == (BlockState.READY, False, 1001, (1, 2))
    again = {d: _row(e.slot) for d, e in rows.items()}  # the bulk path gave its rows generations
    slow, slow_wires, _ = _slot_entries_checked(again, {1, 2, 3, 4, 5, 99}, 8, take)
    assert slow_wires == wires
    assert {d: (e.slot, e.checksum, e.parent, e.token_ids) for d, e in slow.items()} == {
        d: (e.slot, e.checksum, e.parent, e.token_ids) for d, e in entries.items()}


def test_rows_the_log_cannot_place_are_refused() -> None:
    rows = {
        _digest(1): _row(1),
        _digest(2): _row(9),    # slot out of range
        _digest(3): _row(1),    # slot 1 claimed again
        _digest(4): _row(4),    # the log does not hold block 4
        _digest(5): _row(5),
        _digest(6): _row(-1),   # negative slot
    }
    entries, wires, refused = _slot_entries(rows, {1, 2, 3, 5, 6}, 8, _generations())
    assert set(entries) == {_digest(1), _digest(5)}
    assert wires == {1, 5}
    assert refused == [_digest(2), _digest(3), _digest(4), _digest(6)]
    assert len({e.generation for e in entries.values()}) == 2 and 0 not in {e.generation for e in entries.values()}


def test_empty_projection() -> None:
    assert _slot_entries({}, {1}, 8, _generations()) == ({}, set(), [])
