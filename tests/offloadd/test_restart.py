"""Warm restart: kill -9, then the same state, the same bytes; corrupt or lost arenas are dropped
truthfully (logged), never served."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import redis

from events.hashing import to_wire
from events.logkeys import LogKeys
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from events.state import CacheState
from offloadd.client import GroupQuery, IngestStream, OffloadClient, OffloadClientError
from offloadd.slot_generations import SlotGenerations
from tests.offloadd.conftest import GROUP, SLOT, chain, pattern
from tests.support.offloadd_proc import DaemonProcess

N_BLOCKS = 3000


def replay(client: OffloadClient) -> CacheState:
    state = CacheState()
    for record in client.subscribe(1):
        state.apply(record)
    return state


def fill(client: OffloadClient, n: int, per_commit: int = 250, salt: str = "") -> list[bytes]:
    arena = client.register_engine("e", 1, "m", [GROUP]).map_arena(0)
    blocks = chain(n, salt=salt)
    for start in range(0, n, per_commit):
        res = client.reserve("e", 0, blocks[start : start + per_commit])
        for _, slot in res.blocks:
            arena.write(slot, pattern(slot))
        client.commit("e", res.reservation_id)
    arena.close()
    return [b.block_hash for b in blocks]


def flip_byte(proc: DaemonProcess, namespace: str, offset: int) -> None:
    """Corrupt the byte at ``offset`` of the daemon's first arena chunk (daemon stopped)."""
    chunk = proc.arena_dir / f"kvd-{namespace}-L1-C0"
    data = bytearray(chunk.read_bytes())
    data[offset] ^= 0xFF
    chunk.write_bytes(bytes(data))


def test_kill9_restart_same_state_same_bytes(tmp_path: Path, redis_url: str, namespace: str) -> None:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=4096 * SLOT)
    proc.start()
    try:
        with OffloadClient(proc.target) as c:
            hashes = fill(c, N_BLOCKS)
            s = IngestStream(proc.target, "gpu-engine", 3)
            for i in range(100):
                s.submit([BlockStored((i,), None, (1, 2, 3, 4), 4, "GPU")])
            assert s.flush(10)  # the stream stays open: the engine lives on through the restart
            pending = c.reserve("e", 0, chain(2, salt="uncommitted"))  # never committed
            before = c.snapshot()
            lookup = c.lookup("e", [GroupQuery(0, tuple(hashes))])
            assert lookup.results[0].num_prefix == N_BLOCKS
            proc.kill()
            gpu_key = LogKeys(namespace).engine_blocks("gpu-engine")
            admin = redis.Redis.from_url(redis_url)
            assert not admin.exists(gpu_key)  # no per-block GPU projection (DECISIONS 33)
            admin.sadd(gpu_key, "0:5")  # what an older daemon left behind is deleted at start
            proc.restart()
            deadline = time.monotonic() + 5
            while admin.exists(gpu_key) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not admin.exists(gpu_key)
            admin.close()
            after = c.snapshot()
            assert CacheState.from_snapshot(after) == CacheState.from_snapshot(before)
            assert after.offset == before.offset
            assert replay(c) == CacheState.from_snapshot(after)  # reducer over the log == daemon
            again = c.lookup("e", [GroupQuery(0, tuple(hashes))])
            assert again.results[0].slots == lookup.results[0].slots
            arena = c.register_engine("e", 1, "m", [GROUP]).map_arena(0)
            assert all(arena.read(slot) == pattern(slot) for slot in again.results[0].slots)
            stats = c.stats()
            assert (stats.num_blocks, stats.layouts[0].num_reserved) == (N_BLOCKS, 0)
            uncommitted = tuple(b.block_hash for b in chain(2, salt="uncommitted"))
            assert c.lookup("e", [GroupQuery(0, uncommitted)]).results[0].num_prefix == 0
            assert pending.reservation_id  # the old reservation is gone with the old process
            new = c.reserve("e", 0, chain(2, salt="uncommitted"))
            assert [st for st, _ in new.blocks] == [1, 1]
            s.close()
    finally:
        proc.kill()


def test_corrupt_block_dropped_on_restart(tmp_path: Path, redis_url: str, namespace: str) -> None:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=8 * SLOT)
    proc.start()
    try:
        with OffloadClient(proc.target) as c:
            hashes = fill(c, 3)
            proc.kill()
            flip_byte(proc, namespace, SLOT + 5)  # slot 1
            proc.restart()
            deadline = time.monotonic() + 5  # the background verifier finds it, no Lookup needed
            while c.stats().log_offset < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.stats().num_blocks == 2
            q = GroupQuery(0, tuple(hashes), prefix_only=False)
            assert c.lookup("e", [q]).results[0].slots == (0, -1, 2)
            last = list(c.subscribe(1))[-1]
            assert last.events == (BlockRemoved((to_wire(hashes[1]),), "CPU", 0),)
            assert replay(c) == CacheState.from_snapshot(c.snapshot())
            proc.kill()
            proc.restart()  # and the drop itself survives a restart
            assert c.lookup("e", [q]).results[0].slots == (0, -1, 2)
    finally:
        proc.kill()


def test_lost_arena_starts_new_incarnation(tmp_path: Path, redis_url: str, namespace: str) -> None:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=8 * SLOT)
    proc.start()
    try:
        with OffloadClient(proc.target) as c:
            hashes = fill(c, 3)
            path = proc.arena_dir / f"kvd-{namespace}-L1-Cgen"
            table = SlotGenerations(str(path), path.stat().st_size // 8)
            assert min(table[s] for s in range(3)) > 0
            proc.kill()
            (proc.arena_dir / f"kvd-{namespace}.arena-id").unlink()  # the arena is not ours any more
            proc.restart()
            # An engine still mapping the old table finds nothing servable in it.
            assert table.is_stale() and max(table[s] for s in range(len(table))) == 0
            table.close()
            proc.kill()
            shutil.rmtree(proc.arena_dir)  # e.g. the node rebooted and /dev/shm is empty
            proc.restart()
            assert c.stats().num_blocks == 0
            last = list(c.subscribe(1))[-1]
            assert (last.source, last.incarnation, last.source_seq) == ("offloadd", 2, 1)
            assert last.events == (AllBlocksCleared("CPU"),)
            state = replay(c)
            assert state.view() == {}
            with pytest.raises(OffloadClientError) as err:  # old mappings are stale: re-register
                c.lookup("e", [GroupQuery(0, tuple(hashes))])
            assert err.value.code.name == "FAILED_PRECONDITION"
            assert fill(c, 3) == hashes  # serves again
            assert c.lookup("e", [GroupQuery(0, tuple(hashes))]).results[0].num_prefix == 3
    finally:
        proc.kill()


def test_sigterm_is_graceful_and_restart_is_warm(tmp_path: Path, redis_url: str, namespace: str) -> None:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=8 * SLOT)
    proc.start()
    try:
        with OffloadClient(proc.target) as c:
            hashes = fill(c, 4)
            t0 = time.monotonic()
            assert proc.stop() == 0
            assert time.monotonic() - t0 < 5
            assert '"msg": "stopping"' in proc.log_tail()
            proc.restart()
            assert c.lookup("e", [GroupQuery(0, tuple(hashes))]).results[0].num_prefix == 4
    finally:
        proc.kill()



def test_unverified_block_is_checked_before_it_is_served(
    tmp_path: Path, redis_url: str, namespace: str
) -> None:
    """A Lookup racing the background verifier verifies the block itself before returning it."""
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=4096 * SLOT)
    proc.start()
    try:
        with OffloadClient(proc.target) as c:
            hashes = fill(c, 2000)
            proc.kill()
            flip_byte(proc, namespace, 1999 * SLOT)  # the last block of the chain
            proc.restart()
            found = c.lookup("e", [GroupQuery(0, tuple(hashes))])  # immediately
            assert found.results[0].num_prefix == 1999
    finally:
        proc.kill()


def test_restart_keeps_slots_and_gives_new_generations(tmp_path: Path, redis_url: str, namespace: str) -> None:
    """After a restart the blocks are where they were, under generations the old process never
    handed out: an engine's view from before the restart does not pass for current."""
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=8 * SLOT)
    proc.start()
    try:
        with OffloadClient(proc.target) as c:
            hashes = fill(c, 4)
            q = [GroupQuery(0, tuple(hashes))]
            before = c.lookup("e", q).results[0]
            assert min(before.generations) > 0
            # The shared generation table says the same, without asking.
            path = proc.arena_dir / f"kvd-{namespace}-L1-Cgen"
            table = SlotGenerations(str(path), path.stat().st_size // 8)
            assert [table[s] for s in before.slots] == list(before.generations)
            assert sum(table[s] for s in range(len(table))) == sum(before.generations)  # only those
            proc.kill()
            assert [table[s] for s in before.slots] == list(before.generations)  # still true
            proc.restart()
            # Restored blocks are published only once verified, under their new generations.
            assert all(table[s] == 0 or table[s] > max(before.generations) for s in before.slots)
            after = c.lookup("e", q).results[0]
            assert after.slots == before.slots
            assert min(after.generations) > max(before.generations)
            assert [table[s] for s in after.slots] == list(after.generations)
            assert not table.is_stale()  # the same file: a warm restart keeps the arena
            table.close()
    finally:
        proc.kill()
