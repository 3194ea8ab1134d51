"""Pure parts: config from flags and environment, the slot index, LRU and ARC, the arena map."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

from offloadd.arena import ArenaGeometry, ArenaMapping, create_chunk_file
from offloadd.config import ConfigError, OffloaddConfig, load_config
from offloadd.slot_generations import GENERATION_BYTES, SlotGenerations, generations_path
from offloadd.tier.eviction import ArcPolicy, LruPolicy
from offloadd.tier.index import BlockState, LayoutIndex, SlotEntry


def test_config_flags_env_defaults() -> None:
    cfg = load_config(["--capacity-bytes", "1000", "--file-mode", "660"],
                      {"KVD_CHUNK_BYTES": "5000", "REDIS_URL": "redis://x:1/0", "KVD_VERIFY_ON_LOAD": "yes"})
    assert (cfg.capacity_bytes, cfg.chunk_bytes, cfg.file_mode) == (1000, 1000, 0o660)  # chunk clamped
    assert cfg.redis_url == "redis://x:1/0" and cfg.verify_on_load is True
    assert load_config([], {"KVD_REDIS_URL": "redis://a:2/0", "REDIS_URL": "redis://b:3/0"}).redis_url == "redis://a:2/0"
    assert load_config(["--grpc-port", "7"], {"KVD_GRPC_PORT": "8"}).grpc_port == 7
    for argv, env, msg in (
        (["--namespace", "a:b"], {}, "namespace"),
        ([], {"KVD_LEASE_MS": "0"}, "lease_ms"),
        ([], {"KVD_VERIFY_ON_LOAD": "maybe"}, "verify_on_load"),
        ([], {"KVD_HASH_ALGO": "md5"}, "hash_algo"),
        # nan passed every "<= 0" check and inf made a timer never fire; a number names itself
        (["--checkpoint-interval-s", "nan"], {}, r"^checkpoint_interval_s: not a finite number: 'nan'$"),
        ([], {"KVD_OWNER_LEASE_S": "inf"}, r"^owner_lease_s: not a finite number: 'inf'$"),
        (["--grace-s", "soon"], {}, r"^grace_s: not a number: 'soon'$"),
        (["--capacity-bytes", "1e9"], {}, r"^capacity_bytes: not an integer: '1e9'$"),
    ):
        with pytest.raises(ConfigError, match=msg):
            load_config(argv, env)


def test_help_tells_every_flag_its_docstring(capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The attribute docstrings are read only when help is shown (not at every start), and then
    once per flag: each flag's help is its docstring, its variable and its default."""
    monkeypatch.setenv("COLUMNS", "400")  # no long word broken across lines
    with pytest.raises(SystemExit) as done:
        load_config(["--help"], {})
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for field in dataclasses.fields(OffloaddConfig):
        flag = "--" + field.name.replace("_", "-")
        start = text.index(f"{flag} {field.name.upper()} ") + len(flag) + len(field.name) + 2
        help_text = text[start:text.index(f"(env KVD_{field.name.upper()}; default ", start)].strip()
        assert help_text, f"{flag} has no docstring in OffloaddConfig"
        assert "(env KVD_" not in help_text, (flag, help_text)  # its own docstring, once
    assert "Interface for the TCP gRPC listener. (env KVD_GRPC_HOST; default '[::]')" in text


def _entry() -> SlotEntry:
    return SlotEntry(0, 0, 0, None, (1,), b"", None, BlockState.RESERVED)


def _restored(num_slots: int, held: Iterable[int]) -> LayoutIndex:
    idx = LayoutIndex(LruPolicy())
    idx.grow(num_slots)
    idx.insert_ready({s.to_bytes(2, "big"): SlotEntry(s, 0, s, None, (1,), b"", None, BlockState.READY)
                      for s in held})
    idx.rebuild_free()
    return idx


def test_settle_in_steps_makes_what_settle_makes() -> None:
    held = [1, 3, 4, 9, 10, 17, 18, 19]
    whole = _restored(23, held)
    whole.settle()
    free = list(whole.free)
    order = whole.choose_victims(100)
    assert order == sorted(order) and len(order) == len(held)  # restored: all evictable, in order
    for step in (1, 2, 3, 7, 100):
        idx = _restored(23, held)
        steps = sum(1 for _ in idx.settle_steps(step))
        assert steps >= 23 // step  # the free list alone takes one step per `step` slots
        assert idx.free == free and idx.free[-1] == 0  # lowest slot popped first
        assert idx.choose_victims(100) == order  # the same eviction order


def test_settle_steps_give_way_to_a_request_that_needs_the_free_list() -> None:
    """A request between two steps works the free list out itself; the steps then stop and
    leave its list (with the slot it freed or took) as it is: no slot held twice or lost."""
    for request in ("remove", "reserve", "restore again"):
        for after in range(1, 8):
            idx = _restored(12, [1, 3, 4, 8])
            steps = idx.settle_steps(2)
            for _ in range(after):
                next(steps, None)
            if request == "remove":
                idx.mark_evicting((3).to_bytes(2, "big"))
                idx.remove((3).to_bytes(2, "big"))
                want = [11, 10, 9, 7, 6, 5, 3, 2, 0]
            elif request == "reserve":
                slot = idx.take_free_slot()
                assert slot == 0
                idx.reserve(b"new", slot, _entry())
                want = [11, 10, 9, 7, 6, 5, 2]
            else:  # a later restore: what the steps gathered is stale
                idx.insert_ready({b"late": SlotEntry(6, 0, 6, None, (1,), b"", None, BlockState.READY)})
                idx.rebuild_free()
                want = [11, 10, 9, 7, 5, 2, 0]
            for _ in steps:
                pass
            assert sorted(idx.free, reverse=True) == want, (request, after)
            assert not set(idx.free) & {e.slot for e in idx.entries.values()}
            assert len(set(idx.free)) == len(idx.free)


def test_index_transitions() -> None:
    idx = LayoutIndex(LruPolicy())
    idx.grow(3)
    slots = [idx.take_free_slot() for _ in range(3)]
    assert slots == [0, 1, 2] and idx.take_free_slot() is None
    for i, slot in enumerate(slots):
        idx.reserve(bytes([i]), slot, _entry())
    idx.commit(b"\x00", 11)
    idx.commit(b"\x01", 12)
    idx.unreserve(b"\x02")
    assert (idx.num_ready, idx.num_reserved, idx.free) == (2, 0, [2])
    idx.pin(b"\x00")
    assert idx.choose_victims(5) == [b"\x01"]  # pinned is never a victim
    idx.restore([b"\x01"])
    idx.unpin(b"\x00")  # back at the MRU end
    assert idx.choose_victims(1) == [b"\x01"]
    idx.remove(b"\x01")
    assert sorted(idx.free) == [1, 2] and idx.ready(b"\x01") is None
    assert idx.ready(b"\x00") is not None and idx.ready(b"\x00").checksum == 11


def test_restored_index_works_out_free_slots_on_first_use() -> None:
    """After a restore the free list is made on first use (LayoutIndex.rebuild_free): a block
    removed or a reservation dropped before that frees its slot once, not twice."""
    for first in ("remove", "reserve", "settle"):
        idx = LayoutIndex(LruPolicy())
        idx.grow(6)
        idx.insert_ready({bytes([s]): SlotEntry(s, 0, s, None, (1,), b"", None, BlockState.READY)
                          for s in (1, 3, 4)})
        idx.rebuild_free()
        if first == "remove":
            idx.mark_evicting(b"\x03")
            idx.remove(b"\x03")
            assert sorted(idx.free) == [0, 2, 3, 5]
        elif first == "reserve":
            slot = idx.take_free_slot()
            assert slot == 0
            idx.reserve(b"\x09", slot, _entry())
            idx.unreserve(b"\x09")
            assert sorted(idx.free) == [0, 2, 5]
        else:
            idx.settle()
            assert idx.free == [5, 2, 0] and idx.num_free == 3  # lowest popped first
        assert not set(idx.free) & {e.slot for e in idx.entries.values()}
        assert len(set(idx.free)) == len(idx.free)
        assert idx.choose_victims(3) == sorted(idx.entries)  # restored: all evictable


class _ListTable(list[int]):
    """A generation table in a list (the index's side of SlotGenerations)."""

    def set_many(self, items: Iterable[tuple[int, int]]) -> None:
        for slot, generation in items:
            self[slot] = generation

    def is_clear(self) -> bool:
        return not any(self)


def test_index_publishes_what_each_slot_serves() -> None:
    """The generation table holds a slot's generation exactly while its block is READY and
    verified; any step towards giving the slot away clears it first."""
    table = _ListTable([-1] * 4)
    idx = LayoutIndex(LruPolicy(), table)
    idx.grow(4)
    for i, gen in enumerate((101, 102, 103)):
        slot = idx.take_free_slot()
        assert slot is not None
        idx.reserve(bytes([i]), slot, SlotEntry(0, 0, 0, None, (1,), b"", None, BlockState.RESERVED, generation=gen))
    assert table == [0, 0, 0, -1]  # cleared before a writer may touch the slot
    idx.commit(b"\x00", 1)
    idx.commit(b"\x01", 2)
    idx.unreserve(b"\x02")
    assert table == [101, 102, 0, -1]
    assert idx.choose_victims(1) == [b"\x00"]
    assert table[0] == 0  # evicting: no longer servable
    idx.restore([b"\x00"])  # its removal was not logged: the same block again
    assert table[0] == 101
    idx.mark_evicting(b"\x01")
    idx.remove(b"\x01")
    assert table[1] == 0
    # A restored block is published only once its bytes were checked.
    restored = SlotEntry(3, 0, 0, None, (1,), b"", None, BlockState.READY, generation=104, verified=False)
    idx.insert_ready({b"\x03": restored})
    assert table[3] == 0
    idx.mark_verified(b"\x03")
    assert table[3] == 104
    idx.remove(b"\x03")
    verified = SlotEntry(3, 0, 0, None, (1,), b"", None, BlockState.READY, generation=105)
    idx.insert_ready({b"\x04": verified})
    assert table[3] == 105
    idx.mark_evicting(b"\x04")
    idx.remove(b"\x04")
    two = {bytes([5 + i]): SlotEntry(2 + i, 0, 0, None, (1,), b"", None, BlockState.READY,
                                     generation=106 + i, verified=False) for i in range(2)}
    idx.insert_ready(two)
    assert table[2:] == [0, 0]
    idx.mark_verified_many(list(two))
    assert table[2:] == [106, 107] and all(e.verified for e in two.values())


def test_generation_table_set_many_writes_all_at_once(tmp_path: Path) -> None:
    path = generations_path(str(tmp_path / "kvd-t-L1-C{chunk}"))
    daemon = SlotGenerations.create(path, 8, 0o600, None)
    reader = SlotGenerations(path, 8)
    assert daemon.is_clear()  # a restart's restored (unverified) blocks need no write then
    daemon.set_many([(1, 7), (6, 9), (1, 8)])
    assert not daemon.is_clear()
    assert [reader[i] for i in range(8)] == [0, 8, 0, 0, 0, 0, 9, 0]
    os.truncate(path, 8 * GENERATION_BYTES - 8)  # another process shortened it: restored
    reader.close()
    daemon.set_many([(2, 3)])
    assert os.path.getsize(path) == 8 * GENERATION_BYTES
    again = SlotGenerations(path, 8)
    assert [again[i] for i in range(8)] == [0, 8, 3, 0, 0, 0, 9, 0]
    again.close()
    daemon.close()


def test_generation_table_is_shared_and_cleared_on_create(tmp_path: Path) -> None:
    path = generations_path(str(tmp_path / "kvd-t-L1-C{chunk}"))
    assert path.endswith("kvd-t-L1-Cgen")
    daemon = SlotGenerations.create(path, 8, 0o600, None)
    reader = SlotGenerations(path, 8)
    daemon[3] = 2**63 + 5
    assert reader[3] == 2**63 + 5 and reader[2] == 0 and len(reader) == 8
    with pytest.raises(TypeError):
        reader.values[0] = 1  # engines map it read-only
    again = SlotGenerations.create(path, 8, 0o600, None)  # a daemon restart: nothing servable
    assert reader[3] == 0 and not reader.is_stale()
    os.unlink(path)
    assert reader.is_stale()
    small = SlotGenerations.create(path, 2, 0o600, None)
    with pytest.raises(ValueError, match="smaller than"):
        SlotGenerations(path, 8)
    for t in (daemon, reader, again, small):
        t.close()


def test_lru_order_and_touch() -> None:
    p = LruPolicy()
    for k in (b"a", b"b", b"c"):
        p.add(k)
    p.touch(b"a")
    assert p.victims(3) == [b"b", b"c", b"a"]


def test_arc_prefers_evicting_blocks_seen_once() -> None:
    p = ArcPolicy()
    for k in (b"a", b"b", b"c", b"d"):
        p.add(k)
    p.touch(b"a")  # a and b are hit again: frequent
    p.touch(b"b")
    assert p.victims(2) == [b"c", b"d"]
    p.remove(b"c")
    p.evicted(b"c")
    p.add(b"c")  # a ghost hit: c comes back as frequent and T1's target grows
    assert b"c" not in p.victims(1)
    assert len(p) == 4


def test_arena_mapping_shared(tmp_path: Path) -> None:
    g = ArenaGeometry(16, 4, 8, str(tmp_path / "c{chunk}"))
    for chunk in range(2):
        create_chunk_file(g.chunk_path(chunk), g.chunk_file_bytes, 0o600, None)
    assert (tmp_path / "c1").stat().st_mode & 0o777 == 0o600
    a, b = ArenaMapping(g), ArenaMapping(g)
    a.write(5, bytes(range(16)))
    assert b.read(5) == bytes(range(16))  # chunk 1, offset 16
    assert (tmp_path / "c1").read_bytes()[16:32] == bytes(range(16))
    assert a.address(5) - a.address(4) == 16
    torch = sys.modules.get("torch")
    assert a.register_cuda() is bool(torch is not None and torch.cuda.is_available())
    with pytest.raises(IndexError):
        a.slot_view(8)
    with pytest.raises(ValueError):
        a.write(0, b"short")
    assert not a.is_stale()
    (tmp_path / "c1").unlink()
    create_chunk_file(g.chunk_path(1), g.chunk_file_bytes, 0o600, None)
    assert a.is_stale()  # the daemon made a new file: this mapping writes into the old one
    a.close()
    b.close()
