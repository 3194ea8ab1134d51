"""What an attack run broke (issue "truth under faults"), each reproduced against real processes.

After every scenario the daemon still serves a well-behaved client, and what it says it holds
(Stats) equals the CPU tier of its log (replayed with the one reducer).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import cbor2
import grpc
import pytest
from kvcache.v1 import events_pb2, log_pb2, log_pb2_grpc

from events.codec_proto import EventBatch, batch_to_proto
from events.schema import AllBlocksCleared, BlockStored
from events.state import CacheState
from offloadd.client import (
    BlockToStore,
    GroupSpec,
    IngestStream,
    OffloadClient,
    OffloadClientError,
    RetryPolicy,
)
from tests.offloadd.conftest import GROUP, SLOT, chain, digest
from tests.reliability.test_engine_kill9 import _generate, _serve
from tests.support.offloadd_proc import DaemonProcess

ACK = log_pb2.PublishAck

# CBOR that decodes but that the log (msgpack) cannot hold, or that an event cannot carry.
UNLOGGABLE = {
    "tag": cbor2.dumps([cbor2.CBORTag(1234, 5)]),
    "int beyond 2^64": cbor2.dumps([2**70]),
    "negative int beyond -2^63": cbor2.dumps([-(2**70)]),
    "undefined": b"\x81\xf7",          # [undefined]
    "simple value": b"\x81\xf0",       # [simple(16)]
    "map": cbor2.dumps([{"a": 1}]),
    "nested tag": cbor2.dumps([["x", cbor2.CBORTag(99, "y")]]),
}


@pytest.fixture
def daemon(tmp_path: Path, redis_url: str, namespace: str) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=16 * SLOT)
    proc.start()
    yield proc
    proc.kill()


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[OffloadClient]:
    with OffloadClient(daemon.target, retry=RetryPolicy(attempts=1)) as c:
        yield c


def log_state(client: OffloadClient) -> CacheState:
    state = CacheState()
    for record in client.subscribe(1):
        state.apply(record)
    return state


def cpu_blocks_in_log(client: OffloadClient) -> int:
    return sum(n for (_, medium, _), n in log_state(client).counts().items() if medium == "CPU")


def store(client: OffloadClient, blocks: list[BlockToStore]) -> None:
    arena = client.register_engine("good", 1, "m", [GROUP]).map_arena(0)
    res = client.reserve("good", 0, blocks)
    for _, slot in res.blocks:
        arena.write(slot, bytes(SLOT))
    client.commit("good", res.reservation_id)


def gpu_batch(engine: str, seq: int, extra: bytes | None) -> events_pb2.EventBatch:
    msg = batch_to_proto(EventBatch(engine, 1, seq, time.time(), (
        BlockStored((seq,), None, (1, 2, 3, 4), 4, "GPU"),)))
    if extra is not None:
        msg.events[0].block_stored.extra_keys.append(extra)
    return msg


def test_unloggable_extra_keys_are_refused_at_the_edge(daemon: DaemonProcess, client: OffloadClient) -> None:
    """Item 1: refused with INVALID_ARGUMENT / REJECTED before anything is queued for Redis, so
    no write group fails and nobody else's request with it."""
    store(client, chain(2, salt="before"))
    for name, bad in UNLOGGABLE.items():
        with pytest.raises(OffloadClientError) as err:
            client.reserve("good", 0, [BlockToStore(digest(7, name), None, (1, 2, 3, 4), bad)])
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, (name, err.value)
        assert "extra_keys" in err.value.message, (name, err.value.message)
    # Publish: each bad batch is REJECTED, the stream stays open, the next good batch applies.
    batches = []
    for seq, bad in enumerate(UNLOGGABLE.values(), start=1):
        batches += [gpu_batch("pub", seq, bad), gpu_batch("pub", seq, None)]
    with grpc.insecure_channel(daemon.target) as ch:
        acks = list(log_pb2_grpc.EventIngestStub(ch).Publish(iter(batches), timeout=20))
    assert [a.status for a in acks] == [ACK.STATUS_REJECTED, ACK.STATUS_APPLIED] * len(UNLOGGABLE), acks
    assert all("extra_keys" in a.message for a in acks[::2])
    # The well-behaved storer is unharmed and the daemon's word equals its log.
    store(client, chain(3, salt="after"))
    assert client.stats().num_blocks == cpu_blocks_in_log(client) == 5
    assert "Traceback" not in daemon.log_tail(200)


def test_live_registration_is_immutable(client: OffloadClient) -> None:
    """Item 3: a second RegisterEngine for a live engine id with another layout is refused, and so
    is a layout name reused with another geometry; the same registration again is fine."""
    reg = client.register_engine("e", 1, "m", [GROUP])
    assert client.register_engine("e", 1, "m", [GROUP]).groups == reg.groups
    other = GroupSpec(0, "full_attention", 0, 4, SLOT * 2, "uint8", "another-layout")
    with pytest.raises(OffloadClientError) as err:
        client.register_engine("e", 1, "m", [other])
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, err.value
    same_name = GroupSpec(0, "full_attention", 0, 4, SLOT * 2, "uint8", GROUP.layout)
    with pytest.raises(OffloadClientError) as err:
        client.register_engine("f", 1, "m", [same_name])
    assert err.value.code in (grpc.StatusCode.FAILED_PRECONDITION,
                              grpc.StatusCode.INVALID_ARGUMENT), err.value
    # the engine still writes where its registration says
    res = client.reserve("e", 0, chain(1, salt="imm"))
    assert len(res.blocks) == 1


def test_tiny_blocks_are_refused_before_allocating(client: OffloadClient, daemon: DaemonProcess) -> None:
    """Item 6: block_bytes=1 would need a slot table of 8 bytes per byte of capacity."""
    tiny = GroupSpec(0, "full_attention", 0, 4, 1, "uint8", "tiny-layout")
    with pytest.raises(OffloadClientError) as err:
        client.register_engine("t", 1, "m", [tiny])
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert client.register_engine("good", 1, "m", [GROUP]).groups


def test_sigterm_exits_within_5s_with_engines_connected(
    daemon: DaemonProcess, client: OffloadClient, tiny_model: Path,
) -> None:
    """Item 10: engines (real ones, offloading), open ingest streams and a log subscriber that
    follows do not hold up a graceful stop; the stop clears nobody's GPU tier (item 7: they did
    not depart, they reconnect to the next daemon)."""
    streams = [IngestStream(daemon.target, f"conn-{i}") for i in range(3)]
    engines = [_serve(tiny_model, daemon, f"eng-{i}") for i in range(2)]
    try:
        for _, target in engines:
            _generate(target, list(range(1, 100)))
        for i, s in enumerate(streams):
            s.submit((BlockStored((100 + i,), None, (1, 2, 3, 4), 4, "GPU"),))
        assert all(s.flush(10) for s in streams)
        follower = client.subscribe(1, follow=True)
        next(follower)  # a live Subscribe stream that follows the log
        assert daemon.proc is not None
        t0 = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        rc = daemon.proc.wait(timeout=15)
        took = time.monotonic() - t0
    finally:
        for s in streams:
            s.close()
        for proc, _ in engines:
            proc.kill()
            proc.wait()
    assert rc == 0, daemon.log_tail()
    assert took < 5.0, f"SIGTERM took {took:.1f} s"
    daemon.proc = None
    daemon.restart()
    with OffloadClient(daemon.target, retry=RetryPolicy(attempts=1)) as fresh:
        cleared = [r for r in fresh.subscribe(1) if r.incarnation == 0
                   and any(isinstance(e, AllBlocksCleared) for e in r.events)]
        assert cleared == []
        assert {s.source for s in fresh.snapshot().sources} >= {f"conn-{i}" for i in range(3)}
