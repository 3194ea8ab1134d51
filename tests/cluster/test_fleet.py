"""Two nodes' daemons on one Redis: the fleet index (from their logs) says which node holds a
chain; the second node fetches it from the first (pinned, streamed with checksums, stored as
any engine stores) and serves it as its own CPU-tier hit. A layout that differs is a miss;
bytes that fail their checksum end the prefix; a peer that is gone costs an error, never a
wrong block."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from events.hashing import to_wire
from events.logkeys import LogKeys
from offloadd.client import BlockToStore, GroupQuery, OffloadClient, OffloadClientError
from offloadd.client.fleet_fetch import fetch_prefix
from offloadd.fleet.index import FleetIndex
from tests.support.offloadd_proc import DaemonProcess
from tests.support.synthetic_engine import GROUP, SLOT, SyntheticStorer, digest, served_blocks_match

CHAIN = 8


def _chain(engine_id: str) -> list[BlockToStore]:
    return [BlockToStore(digest(engine_id, i), digest(engine_id, i - 1) if i else None, (i, 1, 2, 3))
            for i in range(CHAIN)]


@pytest.fixture
def nodes(tmp_path: Path, redis_url: str) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    a = DaemonProcess(tmp_path / "a", redis_url, "node-a", capacity_bytes=64 * SLOT)
    b = DaemonProcess(tmp_path / "b", redis_url, "node-b", capacity_bytes=64 * SLOT)
    a.start()
    b.start()
    storer = SyntheticStorer(a.target, "a-store", chain_len=CHAIN, max_chains=1).start()
    deadline = time.monotonic() + 20
    while storer.stats.stores < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    storer.stop()
    assert storer.stats.stores == 1
    yield a, b
    a.kill()
    b.kill()


def test_index_then_fetch_serves_the_chain_locally(nodes: tuple[DaemonProcess, DaemonProcess],
                                                    redis_url: str) -> None:
    a, b = nodes
    client = redis.Redis.from_url(redis_url)
    index = FleetIndex(client, {"a": "node-a", "b": "node-b"})
    assert index.refresh() > 0
    wire = [to_wire(blk.block_hash) for blk in _chain("a-store")]
    assert index.holders(wire) == [("a", CHAIN)]
    assert index.holders([to_wire(digest("nobody", 0)), *wire]) == []  # a prefix from the first
    with OffloadClient(b.target) as local, OffloadClient(a.target) as peer:
        arena = local.register_engine("b-eng", 1, "synthetic", [GROUP]).map_arena(0)
        try:
            out = fetch_prefix(local, arena, "b-eng", peer, "synthetic", GROUP, _chain("a-store"))
            assert (out.held, out.fetched, out.present, out.rejected) == (CHAIN, CHAIN, 0, 0)
            served, bad = served_blocks_match(local, "b-eng", arena, [x.block_hash for x in _chain("a-store")])
            assert (served, bad) == (CHAIN, [])
            again = fetch_prefix(local, arena, "b-eng", peer, "synthetic", GROUP, _chain("a-store"))
            assert (again.fetched, again.present) == (0, CHAIN)
        finally:
            arena.close()
    index.refresh()
    assert sorted(index.holders(wire)) == [("a", CHAIN), ("b", CHAIN)]  # b's log says so too
    client.close()


def test_other_layout_is_a_miss(nodes: tuple[DaemonProcess, DaemonProcess]) -> None:
    a, b = nodes
    other = replace(GROUP, block_bytes=2 * SLOT, layout="other-layout")
    with OffloadClient(b.target) as local, OffloadClient(a.target) as peer:
        arena = local.register_engine("b-other", 1, "synthetic", [other]).map_arena(0)
        try:
            out = fetch_prefix(local, arena, "b-other", peer, "synthetic", other, _chain("a-store"))
        finally:
            arena.close()
        assert (out.held, out.fetched) == (0, 0)
        assert local.stats().num_blocks == 0


def test_corrupt_bytes_end_the_prefix(nodes: tuple[DaemonProcess, DaemonProcess]) -> None:
    a, b = nodes
    chain = _chain("a-store")
    with OffloadClient(a.target) as peer:
        peer.register_engine("probe", 1, "synthetic", [GROUP])
        slots = peer.lookup("probe", [GroupQuery(0, (chain[5].block_hash,), prefix_only=False)]).results[0].slots
    with open(a.arena_dir / "kvd-node-a-L1-C0", "r+b") as f:  # a bit flips on node a
        f.seek(slots[0] * SLOT)
        byte = f.read(1)
        f.seek(slots[0] * SLOT)
        f.write(bytes([byte[0] ^ 0xFF]))
    with OffloadClient(b.target) as local, OffloadClient(a.target) as peer:
        arena = local.register_engine("b-eng", 1, "synthetic", [GROUP]).map_arena(0)
        try:
            out = fetch_prefix(local, arena, "b-eng", peer, "synthetic", GROUP, chain)
            assert (out.held, out.fetched, out.rejected) == (CHAIN, 5, 3)
            served, bad = served_blocks_match(local, "b-eng", arena, [x.block_hash for x in chain])
            assert (served, bad) == (5, [])
        finally:
            arena.close()


def test_a_peer_that_is_gone_costs_an_error_not_a_block(nodes: tuple[DaemonProcess, DaemonProcess]) -> None:
    a, b = nodes
    a.kill()
    with OffloadClient(b.target) as local, OffloadClient(f"127.0.0.1:{a.port}", timeout_s=1.0) as peer:
        arena = local.register_engine("b-eng", 1, "synthetic", [GROUP]).map_arena(0)
        try:
            with pytest.raises(OffloadClientError):
                fetch_prefix(local, arena, "b-eng", peer, "synthetic", GROUP, _chain("a-store"))
        finally:
            arena.close()
        stats = local.stats()
        assert stats.num_blocks == 0 and all(s.num_reserved == 0 for s in stats.layouts)


def test_index_of_a_trimmed_log_starts_from_its_checkpoint(tmp_path: Path, redis_url: str) -> None:
    from tests.offloadd.test_checkpoint import CKPT_ARGS, first_offset

    a = DaemonProcess(tmp_path / "a", redis_url, "node-t", capacity_bytes=512 * SLOT, extra_args=CKPT_ARGS)
    a.start()
    admin = redis.Redis.from_url(redis_url)
    try:
        storer = SyntheticStorer(a.target, "t-store", chain_len=4, max_chains=80).start()
        deadline = time.monotonic() + 60
        while (storer.stats.stores < 80 or first_offset(admin, LogKeys("node-t")) <= 2) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        storer.stop()
        assert first_offset(admin, LogKeys("node-t")) > 2  # the first chain's record is trimmed
        index = FleetIndex(admin, {"t": "node-t"})
        index.refresh()
        first_chain = [to_wire(digest("t-store", i)) for i in range(4)]
        assert index.holders(first_chain) == [("t", 4)]
    finally:
        a.kill()
        admin.close()
