"""An arena file resized by another process (an engine may write, so truncate, it): the daemon
never maps it, so it survives, says so once, drops exactly the blocks whose bytes are gone
(logged), gives the file back its size and serves the rest."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from events.hashing import to_wire
from events.schema import BlockRemoved
from events.state import CacheState
from offloadd.client import GroupQuery, OffloadClient, OffloadClientError
from offloadd.slot_generations import SlotGenerations
from tests.offloadd.conftest import GROUP, SLOT, chain, pattern
from tests.support.offloadd_proc import DaemonProcess

SLOTS_PER_CHUNK = 8


def start(tmp_path: Path, redis_url: str, namespace: str) -> DaemonProcess:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=2 * SLOTS_PER_CHUNK * SLOT,
                         chunk_bytes=SLOTS_PER_CHUNK * SLOT)
    proc.start()
    return proc


def fill(client: OffloadClient, n: int, salt: str = "") -> dict[bytes, int]:
    """Store ``n`` blocks (slot bytes: ``pattern(slot)``); returns hash -> slot."""
    arena = client.register_engine("e", 1, "m", [GROUP]).map_arena(0)
    blocks = chain(n, salt=salt)
    res = client.reserve("e", 0, blocks)
    for _, slot in res.blocks:
        arena.write(slot, pattern(slot))
    client.commit("e", res.reservation_id)
    arena.close()  # before anyone truncates: this process must not touch a lost page either
    return {b.block_hash: slot for b, (_, slot) in zip(blocks, res.blocks, strict=True)}


def removed_cpu(client: OffloadClient) -> list[int]:
    return sorted(h for r in client.subscribe(1) for e in r.events
                  if isinstance(e, BlockRemoved) and e.medium == "CPU" for h in e.block_hashes)


def log_cpu(client: OffloadClient) -> set[int]:
    state = CacheState()
    for record in client.subscribe(1):
        state.apply(record)
    return set(state.blocks("offloadd", "CPU", 0))


def wait_for(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def assert_truthful(client: OffloadClient, kept: dict[bytes, int], lost: dict[bytes, int]) -> None:
    """Lookup serves exactly ``kept`` (with their bytes); the log removed exactly ``lost``; Stats
    equals the log's CPU tier."""
    hashes = (*kept, *lost)
    hit = client.lookup("e", [GroupQuery(0, hashes, prefix_only=False)]).results[0]
    assert hit.slots == (*kept.values(), *([-1] * len(lost)))
    got = client.read_blocks("e", 0, list(kept))
    assert [b.data for b in got] == [pattern(slot) for slot in kept.values()]
    wait_for(lambda: removed_cpu(client) == sorted(to_wire(d) for d in lost))
    assert log_cpu(client) == {to_wire(d) for d in kept}
    assert client.stats().num_blocks == len(kept)


def test_chunk_truncated_while_serving(tmp_path: Path, redis_url: str, namespace: str) -> None:
    proc = start(tmp_path, redis_url, namespace)
    try:
        with OffloadClient(proc.target) as c:
            slots = fill(c, 2 * SLOTS_PER_CHUNK)
            chunk1 = proc.arena_dir / f"kvd-{namespace}-L1-C1"
            half = SLOTS_PER_CHUNK // 2 * SLOT
            os.truncate(chunk1, half)  # slots 12..15 are gone
            lost = {d: s for d, s in slots.items() if s >= SLOTS_PER_CHUNK + SLOTS_PER_CHUNK // 2}
            kept = {d: s for d, s in slots.items() if d not in lost}
            assert len(lost) == SLOTS_PER_CHUNK // 2
            with pytest.raises(OffloadClientError) as err:  # its read comes up short
                c.read_blocks("e", 0, [next(iter(lost))])
            assert err.value.code.name == "NOT_FOUND"
            assert_truthful(c, kept, lost)
            assert proc.proc is not None and proc.proc.poll() is None
            text = proc.log_path.read_text()
            assert text.count(f"arena chunk {chunk1} has {half} bytes") == 1  # reported once
            assert chunk1.stat().st_size == SLOTS_PER_CHUNK * SLOT  # given back its size
            # The lost slots are written and served again.
            more = fill(c, len(lost), salt="again")
            assert sorted(more.values()) == sorted(lost.values())
            again = c.lookup("e", [GroupQuery(0, tuple(more))]).results[0]
            assert again.num_prefix == len(lost)
            assert c.stats().num_blocks == 2 * SLOTS_PER_CHUNK
    finally:
        proc.kill()


def test_reserved_slots_lost_to_truncation_fail_their_commit(
    tmp_path: Path, redis_url: str, namespace: str
) -> None:
    proc = start(tmp_path, redis_url, namespace)
    try:
        with OffloadClient(proc.target) as c:
            arena = c.register_engine("e", 1, "m", [GROUP]).map_arena(0)
            res = c.reserve("e", 0, chain(2 * SLOTS_PER_CHUNK))
            for _, slot in res.blocks:
                arena.write(slot, pattern(slot))
            arena.close()
            os.truncate(proc.arena_dir / f"kvd-{namespace}-L1-C1", 0)
            wait_for(lambda: '-L1-C1 has 0 bytes' in proc.log_path.read_text())
            with pytest.raises(OffloadClientError) as err:  # its bytes are gone
                c.commit("e", res.reservation_id)
            assert err.value.code.name == "FAILED_PRECONDITION"
            c.abort("e", res.reservation_id)
            assert fill(c, SLOTS_PER_CHUNK * 2, salt="after")  # the slots serve again
            assert c.stats().num_blocks == 2 * SLOTS_PER_CHUNK
    finally:
        proc.kill()


def test_generation_table_truncated_while_serving(tmp_path: Path, redis_url: str, namespace: str) -> None:
    proc = start(tmp_path, redis_url, namespace)
    try:
        with OffloadClient(proc.target) as c:
            first = fill(c, SLOTS_PER_CHUNK)
            path = proc.arena_dir / f"kvd-{namespace}-L1-Cgen"
            size = path.stat().st_size
            os.truncate(path, 0)
            second = fill(c, SLOTS_PER_CHUNK, salt="more")  # commits publish into the short file
            wait_for(lambda: path.stat().st_size == size)
            assert proc.proc is not None and proc.proc.poll() is None
            assert proc.log_path.read_text().count(f"generation table {path} has") == 1
            hashes = (*first, *second)
            hit = c.lookup("e", [GroupQuery(0, hashes)]).results[0]
            assert hit.num_prefix == 2 * SLOTS_PER_CHUNK
            table = SlotGenerations(str(path), size // 8)  # an engine's view: every entry again
            assert [table[s] for s in hit.slots] == list(hit.generations)
            table.close()
    finally:
        proc.kill()


def test_chunk_truncated_while_down(tmp_path: Path, redis_url: str, namespace: str) -> None:
    proc = start(tmp_path, redis_url, namespace)
    try:
        with OffloadClient(proc.target) as c:
            slots = fill(c, 2 * SLOTS_PER_CHUNK)
            proc.kill()
            chunk1 = proc.arena_dir / f"kvd-{namespace}-L1-C1"
            half = SLOTS_PER_CHUNK // 2 * SLOT
            os.truncate(chunk1, half)
            proc.restart()
            lost = {d: s for d, s in slots.items() if s >= SLOTS_PER_CHUNK + SLOTS_PER_CHUNK // 2}
            kept = {d: s for d, s in slots.items() if d not in lost}
            assert_truthful(c, kept, lost)
            assert f"arena chunk {chunk1} had {half} bytes" in proc.log_path.read_text()
    finally:
        proc.kill()
