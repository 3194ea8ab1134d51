"""What an attack run broke (issue "truth under faults"), each reproduced against real processes.

After every scenario the daemon still serves a well-behaved client, and what it says it holds
(Stats) equals the CPU tier of its log (replayed with the one reducer).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import cbor2
import grpc
import pytest
import zmq
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
from tests.support.bridge_proc import BridgeProcess, FleetSimulator, LogWriter
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


def _replay_all(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> list[int]:
    """Seqs of a whole replay from 0 (up to the end marker)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs: list[int] = []
        while True:
            assert dealer.poll(10_000), "replay did not finish"
            frames = dealer.recv_multipart()
            if frames[2] == b"\xff" * 8:
                return seqs
            seqs.append(int.from_bytes(frames[2], "big"))
    finally:
        dealer.close()


def test_bridge_replay_socket_survives_floods(redis_url: str, tmp_path: Path) -> None:
    """The ZMQ replay door: raw TCP connections sending garbage (not ZMTP) and held open, one
    64 MiB frame, and replay clients that ask for the whole log and never read (their replies
    fill a send queue of HWM 10): a well-behaved client is still answered in full, in order,
    the bridge stays healthy, and it stops cleanly."""
    import redis as redis_lib

    client = redis_lib.Redis.from_url(redis_url)
    sim, writer = FleetSimulator(["eng-a"], seed=11), LogWriter(client)
    sim.write(writer, 30)
    bridge = BridgeProcess(redis_url, tmp_path, "--hwm", "10")
    bridge.start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    held: list[socket.socket] = []
    greedy: list[zmq.Socket[bytes]] = []
    try:
        assert _replay_all(ctx, bridge.replay) == list(range(30))
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", bridge.replay_port), timeout=5)
            s.sendall(os.urandom(256))
            held.append(s)
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(bridge.replay)
        big.send_multipart([b"", b"x" * (64 << 20)])
        greedy.append(big)
        for _ in range(50):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.RCVHWM, 1)
            d.connect(bridge.replay)
            d.send_multipart([b"", (0).to_bytes(8, "big")])
            greedy.append(d)
        time.sleep(1)
        assert _replay_all(ctx, bridge.replay) == list(range(30))
        assert bridge.health()[0] == 200
    finally:
        for s in held:
            s.close()
        for d in greedy:
            d.close()
        ctx.term()
        assert bridge.stop() == 0, bridge.output()[-2000:]
    assert "Traceback" not in bridge.output()


def test_http_slow_bodies_and_bad_text_leave_the_engine_serving(
    tiny_model: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """The OpenAI door of a real engine: 100 clients that announce a 1 MB body, send a byte and
    leave (each logged a 60-line ClientDisconnect traceback before: a log flood), and a body
    with a lone surrogate escape (a bare 500 before). Each is answered or dropped quietly and a
    well-behaved completion follows."""
    import json
    import urllib.error
    import urllib.request

    from engine.config import EngineConfig
    from engine.engine_core import EngineCore
    from engine.engine_loop import EngineLoop
    from engine.http_api import create_app
    from events.prompt import load_chat_template
    from rpc.http_server import ThreadedHttpServer

    loop = EngineLoop(EngineCore(EngineConfig(model_dir=str(tiny_model), num_gpu_blocks=32,
                                              engine_id="http-attack"))).start()
    http = ThreadedHttpServer(create_app(loop, "tiny", load_chat_template(tiny_model))).start()
    url = f"http://127.0.0.1:{http.port}/v1/completions"

    def post(body: bytes) -> tuple[int, dict[str, object]]:
        req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    uvicorn_log = logging.getLogger("uvicorn")  # it does not propagate to the root logger
    uvicorn_log.addHandler(caplog.handler)
    try:
        with caplog.at_level("ERROR"):
            for _ in range(100):
                with socket.create_connection(("127.0.0.1", http.port), timeout=5) as s:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                              b"content-type: application/json\r\nContent-Length: 1000000\r\n\r\n{")
            status, answer = post(b'{"prompt": "a \\udc80", "max_tokens": 2}')
            assert status == 400 and "surrogate" in str(answer["error"]), answer
            status, answer = post(b'{"prompt": "still serving", "max_tokens": 2}')
            assert status == 200 and answer["choices"], answer  # type: ignore[truthy-bool]
            time.sleep(0.5)  # the last disconnects are seen
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert errors == [], errors[:3]
    finally:
        uvicorn_log.removeHandler(caplog.handler)
        http.stop()
        loop.stop()
