"""OffloadStore against a real daemon: round trips through the arena, eviction, leases, pins."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import xxhash

from events.hashing import to_wire
from events.schema import BlockRemoved, BlockStored
from events.state import CacheState
from offloadd.client import (
    GroupQuery,
    NotRegistered,
    OffloadClient,
    OffloadClientError,
    ReserveStatus,
)
from tests.offloadd.conftest import GROUP, SLOT, chain, digest, pattern
from tests.support.offloadd_proc import REPO, DaemonProcess

WRITER = textwrap.dedent("""
    import sys
    from offloadd.client import OffloadClient, GroupSpec, BlockToStore
    from tests.offloadd.conftest import GROUP, chain, pattern
    target = sys.argv[1]
    with OffloadClient(target) as c:
        reg = c.register_engine("writer", 1, "m", [GROUP])
        arena = reg.map_arena(0)
        blocks = chain(5, salt="rt")
        res = c.reserve("writer", 0, blocks)
        for status, slot in res.blocks:
            assert status == 1, res
            arena.write(slot, pattern(slot))
        print(c.commit("writer", res.reservation_id).num_committed)
""")


def test_round_trip_bit_exact_from_second_process(daemon: DaemonProcess, client: OffloadClient) -> None:
    out = subprocess.run(
        [sys.executable, "-c", WRITER, daemon.target], cwd=REPO, capture_output=True, text=True,
        timeout=30, check=True,
    )
    assert out.stdout.strip() == "5"
    chunk = daemon.arena_dir / f"kvd-{daemon.namespace}-L1-C0"
    assert chunk.stat().st_mode & 0o777 == 0o600
    assert chunk.stat().st_size == 16 * SLOT
    reg = client.register_engine("reader", 7, "m", [GROUP])
    assert reg.groups[0].layout_id == 1  # same layout, same blocks
    hashes = tuple(b.block_hash for b in chain(5, salt="rt"))
    found = client.lookup("reader", [GroupQuery(0, hashes)], pin=True)
    hit = found.results[0]
    assert hit.num_prefix == 5 and hit.slots == (0, 1, 2, 3, 4)
    arena = reg.map_arena(0)
    for slot in hit.slots:
        assert arena.read(slot) == pattern(slot)
    remote = client.read_blocks("reader", 0, list(hashes))
    assert [b.data for b in remote] == [pattern(s) for s in hit.slots]
    assert [b.checksum for b in remote] == [xxhash.xxh3_64_intdigest(pattern(s)) for s in hit.slots]
    assert client.release("reader", found.lease_id) == 5
    # the log says exactly one BlockStored(CPU) with the chain of five
    (record,) = list(client.subscribe(1))
    (event,) = record.events
    assert isinstance(event, BlockStored) and event.medium == "CPU"
    assert event.block_hashes == tuple(to_wire(h) for h in hashes)
    assert event.parent_block_hash is None and event.block_size == 4
    assert event.token_ids == tuple(t for b in chain(5, salt="rt") for t in b.token_ids)


def _store(client: OffloadClient, engine: str, blocks: list, tag: int = 0) -> list[int]:
    reg_arena = client.register_engine(engine, 1, "m", [GROUP]).map_arena(0)
    res = client.reserve(engine, 0, blocks)
    slots = [slot for status, slot in res.blocks if status == ReserveStatus.RESERVED]
    for slot in slots:
        reg_arena.write(slot, pattern(slot + tag))
    if res.reservation_id:
        client.commit(engine, res.reservation_id)
    return slots


def test_prefix_lookup_and_already_stored(client: OffloadClient) -> None:
    blocks = chain(4)
    _store(client, "e", blocks[:2])
    res = client.reserve("e", 0, blocks)
    assert [s for s, _ in res.blocks] == [ReserveStatus.ALREADY_STORED] * 2 + [ReserveStatus.RESERVED] * 2
    other = client.reserve("e", 0, blocks[2:])
    assert [s for s, _ in other.blocks] == [ReserveStatus.IN_FLIGHT] * 2
    assert other.reservation_id == ""
    q = GroupQuery(0, tuple(b.block_hash for b in blocks))
    assert client.lookup("e", [q]).results[0].num_prefix == 2  # reserved ones are invisible
    assert client.lookup("e", [q]).results[0].slots == (0, 1, -1)  # prefix_only stops at a miss
    full = client.lookup("e", [GroupQuery(0, q.block_hashes, prefix_only=False)])
    assert full.results[0].slots == (0, 1, -1, -1)
    assert client.abort("e", res.reservation_id) == 2
    stats = client.stats()
    assert (stats.num_blocks, stats.layouts[0].num_reserved) == (2, 0)


def test_lru_eviction_order_is_logged(client: OffloadClient) -> None:
    # capacity 16 slots: fill them, touch the first four, then store four more
    first = chain(16, salt="a")
    _store(client, "e", first)
    client.lookup("e", [GroupQuery(0, tuple(b.block_hash for b in first[:4]))])
    more = chain(4, salt="b")
    slots = _store(client, "e", more)
    assert len(slots) == 4
    removed = [e for r in client.subscribe(1) for e in r.events if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved(tuple(to_wire(b.block_hash) for b in first[4:8]), "CPU", 0)]
    assert sorted(slots) == [4, 5, 6, 7]
    q = GroupQuery(0, tuple(b.block_hash for b in first), prefix_only=False)
    assert [s >= 0 for s in client.lookup("e", [q]).results[0].slots] == (
        [True] * 4 + [False] * 4 + [True] * 8
    )
    assert client.stats().evictions == 4


def test_pinned_blocks_survive_pressure(client: OffloadClient) -> None:
    first = chain(16, salt="p")
    _store(client, "e", first)
    pinned = client.lookup("e", [GroupQuery(0, tuple(b.block_hash for b in first))], pin=True)
    assert pinned.results[0].num_prefix == 16
    with pytest.raises(OffloadClientError) as err:
        client.reserve("e", 0, chain(2, salt="q"))
    assert err.value.code.name == "RESOURCE_EXHAUSTED"
    assert "pinned or reserved" in err.value.message
    assert client.stats().num_blocks == 16
    client.release("e", pinned.lease_id)
    assert len(_store(client, "e", chain(2, salt="q"))) == 2


def test_leases_and_reservations_expire(tmp_path, redis_url: str, namespace: str) -> None:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=4 * SLOT, lease_ms=1000)
    proc.start()
    try:
        with OffloadClient(proc.target) as c:
            _store(c, "e", chain(2, salt="x"))
            lease = c.lookup("e", [GroupQuery(0, tuple(b.block_hash for b in chain(2, salt="x")))],
                             pin=True)
            res = c.reserve("e", 0, chain(2, salt="y"))
            assert c.stats().layouts[0].num_reserved == 2
            assert c.stats().layouts[0].num_pinned == 2
            deadline = time.monotonic() + 10
            while c.stats().layouts[0].num_reserved and time.monotonic() < deadline:
                time.sleep(0.05)
            s = c.stats().layouts[0]
            assert (s.num_reserved, s.num_pinned, s.num_ready) == (0, 0, 2)
            for call in (lambda: c.commit("e", res.reservation_id),
                         lambda: c.release("e", lease.lease_id)):
                with pytest.raises(OffloadClientError) as err:
                    call()
                assert err.value.code.name == "FAILED_PRECONDITION"
                assert "unknown or expired" in err.value.message
            # the freed slots are reusable, and nothing about the aborted blocks was logged
            assert len(_store(c, "e", chain(2, salt="z"))) == 2
            state = CacheState()
            for r in c.subscribe(1):
                state.apply(r)
            assert state.view()[("offloadd", "CPU", 0)] == frozenset(
                to_wire(b.block_hash) for b in chain(2, salt="x") + chain(2, salt="z")
            )
    finally:
        proc.kill()


def test_commit_subset_aborts_the_rest(client: OffloadClient) -> None:
    blocks = chain(3, salt="s")
    client.register_engine("e", 1, "m", [GROUP])
    res = client.reserve("e", 0, blocks)
    out = client.commit("e", res.reservation_id, [blocks[0].block_hash, blocks[2].block_hash])
    assert out.num_committed == 2
    (record,) = list(client.subscribe(1))
    # not consecutive in the chain: two events
    assert [e.block_hashes for e in record.events] == [
        (to_wire(blocks[0].block_hash),), (to_wire(blocks[2].block_hash),)
    ]
    assert client.stats().layouts[0].num_reserved == 0


def test_engines_with_other_layouts_do_not_share(client: OffloadClient) -> None:
    _store(client, "e", chain(1))
    other = client.register_engine("f", 1, "other-model", [GROUP])
    assert other.groups[0].layout_id == 2
    assert client.lookup("f", [GroupQuery(0, (digest(0),))]).results[0].num_prefix == 0


def test_verify_on_load_drops_corrupt_block(tmp_path, redis_url: str, namespace: str) -> None:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=4 * SLOT,
                         extra_args=("--verify-on-load", "true", "--eviction", "arc"))
    proc.start()
    try:
        with OffloadClient(proc.target) as c:
            blocks = chain(2, salt="v")
            slots = _store(c, "e", blocks)
            arena = c.register_engine("e", 1, "m", [GROUP]).map_arena(0)
            arena.write(slots[1], bytes(SLOT))  # someone scribbles over a committed block
            q = GroupQuery(0, tuple(b.block_hash for b in blocks))
            assert c.lookup("e", [q]).results[0].slots == (slots[0], -1)
            # Every load must ask (and be verified): nothing is published to skip the asking.
            table = c.register_engine("e", 1, "m", [GROUP]).map_generations(0)
            assert max(table[s] for s in range(len(table))) == 0
            table.close()
            deadline = time.monotonic() + 5
            while c.stats().log_offset < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            last = list(c.subscribe(1))[-1]
            assert last.events == (BlockRemoved((to_wire(blocks[1].block_hash),), "CPU", 0),)
            assert c.stats().num_blocks == 1 and c.stats().evictions == 0
    finally:
        proc.kill()


def test_reserve_does_not_evict_what_it_reports_stored(client: OffloadClient) -> None:
    first = chain(16, salt="w")
    _store(client, "e", first)
    res = client.reserve("e", 0, [first[0], *chain(1, salt="new")])  # first[0] is the LRU one
    assert [s for s, _ in res.blocks] == [ReserveStatus.ALREADY_STORED, ReserveStatus.RESERVED]
    removed = [e for r in client.subscribe(1) for e in r.events if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved((to_wire(first[1].block_hash),), "CPU", 0)]


def test_generations_name_each_assignment_of_a_slot(client: OffloadClient) -> None:
    """Reserve and Lookup give each slot's generation: one assignment of that slot to that
    block. A slot given again, even to the very block it held before, gets a new one: what an
    engine that read a remembered slot checks the pin's answer against (engine.offload.view)."""
    table = client.register_engine("e", 1, "m", [GROUP]).map_generations(0)
    first = chain(16, salt="g")  # the arena's 16 slots
    res = client.reserve("e", 0, first)
    gens = res.generations
    assert len(gens) == 16 and min(gens) > 0 and len(set(gens)) == 16
    assert [table[s] for s in range(16)] == [0] * 16  # reserved: not servable yet
    client.commit("e", res.reservation_id)
    assert [table[slot] for _, slot in res.blocks] == list(gens)  # published on commit
    again = client.reserve("e", 0, first[:2])
    assert [s for s, _ in again.blocks] == [ReserveStatus.ALREADY_STORED] * 2
    assert again.generations == (0, 0)
    hashes = tuple(b.block_hash for b in first)
    hit = client.lookup("e", [GroupQuery(0, (*hashes, digest(99, "missing")), prefix_only=False)]).results[0]
    assert hit.generations == (*gens, 0)
    assert hit.slots[:16] == tuple(slot for _, slot in res.blocks)
    slot0 = res.blocks[0][1]
    client.lookup("e", [GroupQuery(0, hashes[1:])])  # first[0] is now the least recently used
    assert _store(client, "e", chain(1, salt="other")) == [slot0]
    assert client.lookup("e", [GroupQuery(0, hashes[:1])]).results[0].slots == (-1,)
    client.lookup("e", [GroupQuery(0, hashes[1:])])  # and now the other block is
    assert _store(client, "e", first[:1]) == [slot0]
    back = client.lookup("e", [GroupQuery(0, hashes[:1])]).results[0]
    assert back.slots == (slot0,) and back.generations[0] > max(gens)
    assert table[slot0] == back.generations[0]  # the table follows every assignment
    table.close()


def test_lookup_future_answers_as_lookup_does(client: OffloadClient) -> None:
    """The Lookup an engine sends while it already loads (engine.offload.view): same answer,
    same errors, from ``result()``."""
    blocks = chain(3)
    _store(client, "e", blocks)
    q = [GroupQuery(0, tuple(b.block_hash for b in blocks), prefix_only=False)]
    fut = client.lookup_future("e", q, pin=True)
    got = fut.result(timeout=5)
    assert fut.done()
    assert got.results == client.lookup("e", q).results and got.lease_id
    assert client.release("e", got.lease_id) == 3
    with pytest.raises(NotRegistered, match="not registered"):
        client.lookup_future("nobody", q).result(timeout=5)
    with pytest.raises(OffloadClientError, match="INVALID_ARGUMENT"):
        client.lookup_future("e", [GroupQuery(0, (b"short",))]).result(timeout=5)
