"""RegisterEngine is immutable for a live incarnation, and cheap or rejected input allocates
nothing that stays (issue "truth under faults", items 3 and 6)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from events.codec_proto import EventBatch
from events.logkeys import LogKeys
from events.schema import BlockStored
from events.state import CacheState
from offloadd.client import GroupQuery, GroupSpec, OffloadClient, OffloadClientError
from offloadd.log.ingest import AckStatus, Ingest
from offloadd.log.metadata import MetadataStore
from tests.offloadd.conftest import GROUP, SLOT, chain
from tests.support.offloadd_proc import DaemonProcess


def expect(code: str, fragment: str, call: Callable[[], Any]) -> None:
    with pytest.raises(OffloadClientError) as err:
        call()
    assert err.value.code.name == code, err.value
    assert fragment in err.value.message, err.value.message


def group(idx: int = 0, block_bytes: int = SLOT, layout: str = GROUP.layout) -> GroupSpec:
    return GroupSpec(idx, "full_attention", 0, 4, block_bytes, "uint8", layout)


def test_rejected_publishes_leave_no_per_engine_lock(redis_url: str) -> None:
    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        state = CacheState()
        ingest = Ingest(MetadataStore(client, LogKeys("locks"), state), state, 64)
        stored = (BlockStored((1,), None, (1, 2, 3, 4), 4, "GPU"),)
        for i in range(2000):
            ack = await ingest.publish(EventBatch(f"e{i:04d}-" + "x" * 100, 0, 1, time.time(), stored))
            assert ack.status is AckStatus.REJECTED and "incarnation" in ack.message
        for i in range(2000):
            ack = await ingest.publish(EventBatch(f"{i:04d}" + "y" * 2048, 1, 1, time.time(), stored))
            assert ack.status is AckStatus.REJECTED and "longer than 256 bytes" in ack.message
        assert ingest._locks == {}
        # concurrent batches of one engine are still fenced in order, and leave nothing either
        acks = await asyncio.gather(*(
            ingest.publish(EventBatch("e", 1, seq, time.time(), stored)) for seq in (1, 2)
        ))
        assert [a.status for a in acks] == [AckStatus.APPLIED, AckStatus.APPLIED]
        assert ingest._locks == {}
        await client.aclose()

    asyncio.run(scenario())


def test_same_incarnation_is_idempotent_or_refused(client: OffloadClient) -> None:
    reg = client.register_engine("e", 3, "m", [GROUP])
    assert client.register_engine("e", 3, "m", [GROUP]).groups == reg.groups
    expect("FAILED_PRECONDITION", "block_bytes 512 (registered: 256)",
           lambda: client.register_engine("e", 3, "m", [group(block_bytes=2 * SLOT, layout="other")]))
    expect("FAILED_PRECONDITION", "model_namespace 'm', not 'n'",
           lambda: client.register_engine("e", 3, "n", [GROUP]))
    expect("FAILED_PRECONDITION", "groups [0], not [0, 1]",
           lambda: client.register_engine("e", 3, "m", [GROUP, group(1, layout="g1")]))
    expect("FAILED_PRECONDITION", "incarnation 2 is older than the registered incarnation 3",
           lambda: client.register_engine("e", 2, "m", [GROUP]))
    # a layout name keeps its geometry, whoever asks
    expect("FAILED_PRECONDITION", "block_bytes 512 (registered: 256)",
           lambda: client.register_engine("f", 1, "m", [group(block_bytes=2 * SLOT)]))
    assert client.stats().num_engines == 1
    assert [s.layout_id for s in client.stats().layouts] == [reg.groups[0].layout_id]


def test_new_incarnation_registers_anew_and_drops_the_old_claims(client: OffloadClient) -> None:
    client.register_engine("e", 1, "m", [GROUP])
    res = client.reserve("e", 0, chain(2, salt="c"))
    client.commit("e", res.reservation_id)
    found = client.lookup("e", [GroupQuery(0, tuple(b.block_hash for b in chain(2, salt="c")))], pin=True)
    assert found.lease_id
    open_res = client.reserve("e", 0, chain(1, salt="open"))
    assert client.stats().layouts[0].num_pinned == 2 and client.stats().layouts[0].num_reserved == 1
    reg = client.register_engine("e", 2, "m", [group(block_bytes=2 * SLOT, layout="bigger")])
    assert reg.groups[0].slot_bytes == 2 * SLOT
    old = client.stats().layouts[0]
    assert (old.num_pinned, old.num_reserved, old.num_ready) == (0, 0, 2)
    expect("FAILED_PRECONDITION", "unknown or expired", lambda: client.commit("e", open_res.reservation_id))
    expect("FAILED_PRECONDITION", "unknown or expired", lambda: client.release("e", found.lease_id))


def test_bad_geometry_and_ids_are_invalid(client: OffloadClient) -> None:
    expect("INVALID_ARGUMENT", "below the minimum of 256",
           lambda: client.register_engine("t", 1, "m", [group(block_bytes=1, layout="tiny")]))
    expect("INVALID_ARGUMENT", "engine_id is longer than 256 bytes",
           lambda: client.register_engine("x" * 257, 1, "m", [GROUP]))
    expect("INVALID_ARGUMENT", "layout is longer than 256 bytes",
           lambda: client.register_engine("t", 1, "m", [group(layout="l" * 300)]))
    expect("INVALID_ARGUMENT", "exceeds the arena capacity",
           lambda: client.register_engine("t", 1, "m", [group(block_bytes=1 << 40, layout="huge")]))
    assert client.stats().layouts == () and client.stats().num_engines == 0


def test_slot_tables_stay_within_the_capacity(client: OffloadClient, daemon: DaemonProcess) -> None:
    """16 slots of 256 bytes: each 256-byte layout's table is 128 bytes; a quarter of the
    capacity (1024 bytes) holds 8 of them."""
    many = [group(i, layout=f"l{i}") for i in range(9)]
    expect("RESOURCE_EXHAUSTED", "slot tables", lambda: client.register_engine("t", 1, "m", many))
    assert client.stats().layouts == () and client.stats().num_engines == 0
    assert not list(Path(daemon.arena_dir).glob("kvd-*-L*"))  # no table, no chunk file
    assert len(client.register_engine("t", 1, "m", many[:8]).groups) == 8


@pytest.mark.parametrize("limits", [("--max-layouts", "2", "--max-engines", "2")])
def test_layout_and_engine_caps(tmp_path: Path, redis_url: str, namespace: str, limits: tuple[str, ...]) -> None:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=64 * SLOT, extra_args=limits)
    proc.start()
    try:
        with OffloadClient(proc.target) as c:
            three = [group(i, layout=f"l{i}") for i in range(3)]
            expect("RESOURCE_EXHAUSTED", "limit of 2", lambda: c.register_engine("a", 1, "m", three))
            c.register_engine("a", 1, "m", three[:2])
            c.register_engine("b", 1, "m", three[:1])
            expect("RESOURCE_EXHAUSTED", "2 engines are registered",
                   lambda: c.register_engine("c", 1, "m", [GROUP]))
            assert c.register_engine("b", 2, "m", three[1:2]).groups  # a restart is no new engine
            assert c.stats().num_engines == 2 and len(c.stats().layouts) == 2
    finally:
        proc.kill()
