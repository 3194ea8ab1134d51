"""kv-bridge seen by a stock vLLM-style subscriber: its own msgspec schema written from WIRE.md,
SUB with topic equality, DEALER replay. Nothing of ours is used on the receiving side."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
import zmq

from events.schema import BlockRemoved, BlockStored, LogRecord
from tests.events.vllm_schema import (
    KVEventBatch,
    LBlockRemoved,
    LBlockStored,
    LegacyBatch,
    VBlockRemoved,
    VBlockStored,
)
from tests.support.bridge_proc import BridgeProcess, FleetSimulator, LogWriter
from tests.support.redis_proc import free_port

END = b"\xff" * 8


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _sub(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, topic: bytes) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.connect(endpoint)
    return sock


def _wait_joined(sub: zmq.Socket[bytes], writer: LogWriter, sim: FleetSimulator) -> list[LogRecord]:
    """Write records until the SUB gets one (the PUB drops what it sends before the join)."""
    written: list[LogRecord] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        written += sim.write(writer, 1)
        if sub.poll(100):
            return written
    raise AssertionError("subscriber never joined")


def _recv_live(sub: zmq.Socket[bytes], n: int) -> list[list[bytes]]:
    out = []
    for _ in range(n):
        assert sub.poll(5000), f"only {len(out)} of {n} messages arrived"
        out.append(sub.recv_multipart())
    return out


def _recv_through(sub: zmq.Socket[bytes], seq: int) -> list[list[bytes]]:
    """Live messages up to and including the one with ``seq``."""
    out: list[list[bytes]] = []
    while not out or int.from_bytes(out[-1][1], "big") < seq:
        assert sub.poll(5000), f"seq {seq} never arrived ({len(out)} messages before)"
        out.append(sub.recv_multipart())
    return out


def _replay(dealer: zmq.Socket[bytes], start: int) -> list[list[bytes]]:
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        assert dealer.poll(5000), "replay did not finish"
        frames = dealer.recv_multipart()
        out.append(frames)
        if frames[2] == END:
            return out


def _expected_wire(record: LogRecord) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for e in record.events:
        if isinstance(e, BlockStored):
            out.append(
                ("S", list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.medium)
            )
        elif isinstance(e, BlockRemoved):
            out.append(("R", list(e.block_hashes), e.medium))
    return out


def _got_wire(batch: KVEventBatch | LegacyBatch) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for e in batch.events:
        if isinstance(e, VBlockStored | LBlockStored):
            out.append(("S", e.block_hashes, e.parent_block_hash, e.token_ids, e.medium))
        elif isinstance(e, VBlockRemoved | LBlockRemoved):
            out.append(("R", e.block_hashes, e.medium))
    return out


def test_stock_subscriber_decodes_every_batch_and_replays_from_seq(
    redis_url: str, client: redis.Redis, zctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    writer, sim = LogWriter(client), FleetSimulator(["engine-a", "engine-b", "offloadd"], seed=1)
    bridge = BridgeProcess(redis_url, tmp_path, "--topic", "test")
    bridge.start()
    try:
        sub = _sub(zctx, bridge.pub, b"test")
        written = _wait_joined(sub, writer, sim)
        first = sub.recv_multipart()
        written += sim.write(writer, 40)
        live = [first, *_recv_live(sub, 40)]
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        by_offset = {r.offset: r for r in written}
        seqs = []
        for topic, seq_frame, payload in live:
            assert topic == b"test"
            seq = int.from_bytes(seq_frame, "big")
            seqs.append(seq)
            batch = decoder.decode(payload)
            assert batch.data_parallel_rank == 0
            assert _got_wire(batch) == _expected_wire(by_offset[seq + 1])  # seq = offset - 1
        assert seqs == list(range(seqs[0], seqs[0] + 41))
        assert seqs[-1] == written[-1].offset - 1

        dealer = zctx.socket(zmq.DEALER)
        dealer.connect(bridge.replay)
        n = written[-1].offset
        reply = _replay(dealer, 5)
        assert [f[2] for f in reply[:-1]] == [s.to_bytes(8, "big") for s in range(5, n)]
        assert all(f[:2] == [b"", b"test"] for f in reply[:-1])
        for f in reply[:-1]:
            seq = int.from_bytes(f[2], "big")
            assert _got_wire(decoder.decode(f[3])) == _expected_wire(by_offset[seq + 1])
        assert reply[-1] == [b"", b"", END, b""]
        assert _replay(dealer, n + 10) == [[b"", b"", END, b""]]
    finally:
        assert bridge.stop() == 0


def test_legacy_layout_decodes_with_a_v023_schema(
    redis_url: str, client: redis.Redis, zctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    writer, sim = LogWriter(client), FleetSimulator(["engine-a"], seed=2)
    written = sim.write(writer, 12)
    bridge = BridgeProcess(redis_url, tmp_path, "--topic", "", "--layout", "legacy")
    bridge.start()
    try:
        dealer = zctx.socket(zmq.DEALER)
        dealer.connect(bridge.replay)
        decoder = msgspec.msgpack.Decoder(LegacyBatch)
        got = [f[1:] for f in _replay(dealer, 0)]
        assert got[-1] == [b"", END, b""]
        got = got[:-1]
        assert [int.from_bytes(f[1], "big") for f in got] == list(range(12))
        assert all(f[0] == b"" for f in got)  # the topic is the empty string here
        for f, record in zip(got, written, strict=True):
            assert _got_wire(decoder.decode(f[2])) == _expected_wire(record)
    finally:
        bridge.stop()


def test_malformed_replay_requests_are_ignored_and_service_continues(
    redis_url: str, client: redis.Redis, zctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    writer, sim = LogWriter(client), FleetSimulator(["engine-a"], seed=3)
    sim.write(writer, 5)
    bridge = BridgeProcess(redis_url, tmp_path)
    bridge.start()
    try:
        dealer = zctx.socket(zmq.DEALER)
        dealer.connect(bridge.replay)
        dealer.send_multipart([b"", b"abc"])  # seq too short
        dealer.send_multipart([b"", b"\x00" * 9])  # seq too long
        dealer.send_multipart([b"x", b"\x00" * 8])  # no empty delimiter
        dealer.send_multipart([b"", b"\x00" * 8, b"topic", b"extra"])  # too many frames
        dealer.send_multipart([b"", END])  # the end marker is no start seq
        assert not dealer.poll(300), "a malformed request got an answer"
        dealer.send_multipart([b"", b"\x00" * 8, b"no-such-topic"])  # well formed, no such stream
        assert dealer.poll(5000)
        assert dealer.recv_multipart() == [b"", b"error: no stream has topic 'no-such-topic' (yet)", END, b""]
        reply = _replay(dealer, 3)
        assert [int.from_bytes(f[2], "big") for f in reply[:-1]] == [3, 4]
        assert bridge.health()[0] == 200
        assert 'kvbridge_replay_requests_total{kind="malformed"} 5.0' in bridge.metrics()
    finally:
        assert bridge.stop() == 0


def test_one_bridge_serves_both_layouts(
    redis_url: str, client: redis.Redis, zctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    """--legacy-pub/--legacy-replay: the same batches under the same seqs, one pair per layout;
    a v0.33 decoder reads one, a v0.23 (vLLM's example subscriber) decoder the other."""
    writer, sim = LogWriter(client), FleetSimulator(["engine-a", "offloadd"], seed=5)
    early = sim.write(writer, 6)
    legacy_pub = f"tcp://127.0.0.1:{free_port()}"
    legacy_replay = f"tcp://127.0.0.1:{free_port()}"
    bridge = BridgeProcess(redis_url, tmp_path, "--topic", "", "--start", "beginning",
                           "--legacy-pub", legacy_pub, "--legacy-replay", legacy_replay)
    bridge.start()
    try:
        map_sub, legacy_sub = _sub(zctx, bridge.pub, b""), _sub(zctx, legacy_pub, b"")
        joined = []
        deadline = time.monotonic() + 10
        while not (map_sub.poll(50) and legacy_sub.poll(50)):  # both joined
            assert time.monotonic() < deadline, "subscribers never joined"
            joined += sim.write(writer, 1)
        written = sim.write(writer, 15)
        by_offset = {r.offset: r for r in early + joined + written}
        # Both are subscribed: each gets every batch from here on, whatever of the joining
        # writes it has or has not seen yet (the two PUBs are not in step with each other).
        seqs = [r.offset - 1 for r in written]
        map_live, legacy_live = (_recv_through(sock, seqs[-1])[-15:] for sock in (map_sub, legacy_sub))
        assert [int.from_bytes(f[1], "big") for f in map_live] == seqs
        assert [f[:2] for f in map_live] == [f[:2] for f in legacy_live]
        for (_, seq, m), (_, _, legacy) in zip(map_live, legacy_live, strict=True):
            want = _expected_wire(by_offset[int.from_bytes(seq, "big") + 1])
            assert _got_wire(msgspec.msgpack.decode(m, type=KVEventBatch)) == want
            assert _got_wire(msgspec.msgpack.decode(legacy, type=LegacyBatch)) == want
            with pytest.raises(msgspec.ValidationError):
                msgspec.msgpack.decode(legacy, type=KVEventBatch)

        dealer = zctx.socket(zmq.DEALER)
        dealer.connect(legacy_replay)
        reply = _replay(dealer, 0)
        assert reply[-1] == [b"", b"", END, b""]
        n = max(by_offset)
        assert [int.from_bytes(f[2], "big") for f in reply[:-1]] == list(range(n))
        for f in reply[:-1]:
            batch = msgspec.msgpack.decode(f[3], type=LegacyBatch)
            assert _got_wire(batch) == _expected_wire(by_offset[int.from_bytes(f[2], "big") + 1])
        dealer.send_multipart([b"", b"snapshot"])
        snapshot = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            if frames[3] == b"":
                assert int.from_bytes(frames[2], "big") == n  # the live seq to continue from
                break
            snapshot.append(msgspec.msgpack.decode(frames[3], type=LegacyBatch))
        assert snapshot and all(isinstance(e, LBlockStored) for b in snapshot for e in b.events)
    finally:
        assert bridge.stop() == 0


def test_legacy_pair_keeps_the_map_pairs_seqs_past_a_record_it_cannot_encode(
    redis_url: str, client: redis.Redis, zctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    """A medium outside our schema: the map layout publishes it (the state counts the
    violation), the legacy layout cannot; the legacy pair skips that seq, not renumbers."""
    writer = LogWriter(client)
    for i in range(5):
        medium = "DISK" if i == 2 else "GPU"
        writer.append("e", [BlockRemoved((i,), medium)])  # type: ignore[arg-type]
    legacy_pub, legacy_replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    bridge = BridgeProcess(redis_url, tmp_path, "--start", "beginning",
                           "--legacy-pub", legacy_pub, "--legacy-replay", legacy_replay)
    bridge.start()
    try:
        seqs: dict[str, list[int]] = {}
        for name, endpoint in (("map", bridge.replay), ("legacy", legacy_replay)):
            dealer = zctx.socket(zmq.DEALER)
            dealer.connect(endpoint)
            deadline = time.monotonic() + 10
            while True:  # the bridge may not have published the whole log yet: ask again
                seqs[name] = [int.from_bytes(f[2], "big") for f in _replay(dealer, 0)[:-1]]
                if (seqs[name] and seqs[name][-1] == 4) or time.monotonic() > deadline:  # seq 4: the last record
                    break
                time.sleep(0.05)
        assert seqs == {"map": [0, 1, 2, 3, 4], "legacy": [0, 1, 3, 4]}
    finally:
        assert bridge.stop() == 0


def test_a_snapshot_that_cannot_be_built_is_answered_with_an_error(
    redis_url: str, client: redis.Redis, zctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    """The bridge's state keeps token ids packed (events.packed) and reads them for a snapshot.
    A record no daemon writes, whose ids are not integers, is published as stored; a snapshot
    while its block is resident gets the error end marker, not silence, and the bridge goes on."""
    from events.packed import PackedStored

    writer = LogWriter(client)
    junk = PackedStored((7,), None, msgspec.Raw(msgspec.msgpack.encode(["x", "y"])), 2, "GPU")  # type: ignore[arg-type]
    writer.append("engine-a", [BlockStored((1,), None, (1, 2), 2, "GPU")], source_seq=1)
    writer.append("engine-a", [junk], source_seq=2)
    bridge = BridgeProcess(redis_url, tmp_path, "--start", "beginning")
    bridge.start()
    try:
        dealer = zctx.socket(zmq.DEALER)
        dealer.connect(bridge.replay)
        dealer.send_multipart([b"", b"snapshot"])
        assert dealer.poll(5000), "the snapshot request got no answer"
        empty, error, end, payload = dealer.recv_multipart()
        assert (empty, end, payload) == (b"", END, b"")
        assert error.startswith(b"error: the snapshot cannot be built: BlockStored.token_ids")
        writer.append("engine-a", [BlockRemoved((7,), "GPU")], source_seq=3)
        deadline = time.monotonic() + 10
        while True:  # once the block is gone, snapshots are answered again
            dealer.send_multipart([b"", b"snapshot"])
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            if not frames[1].startswith(b"error: "):
                break
            assert time.monotonic() < deadline, "snapshots still fail after the block left"
            time.sleep(0.1)
        batches = [frames]
        while batches[-1][3] != b"":
            assert dealer.poll(5000)
            batches.append(dealer.recv_multipart())
        stored = [e for f in batches[:-1] for e in msgspec.msgpack.decode(f[3], type=KVEventBatch).events]
        assert [e.block_hashes for e in stored] == [[1]]
        assert bridge.health()[0] == 200
    finally:
        assert bridge.stop() == 0
