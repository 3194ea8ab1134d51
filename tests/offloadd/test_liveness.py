"""Engine liveness (DESIGN 3.7; issue "truth under faults" items 7 and 10), against a real daemon.

A Publish stream that ends cleanly clears its engine's GPU tier at once; one that breaks starts a
lease (here 1.5 s) that a reconnect cancels; a daemon's own stop clears nobody and is quick.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kvcache.v1 import events_pb2, log_pb2, log_pb2_grpc

from events.codec_proto import EventBatch, batch_to_proto
from events.schema import AllBlocksCleared, BlockStored
from offloadd.client import IngestStream, OffloadClient, RetryPolicy
from tests.offloadd.conftest import SLOT
from tests.support.offloadd_proc import REPO, DaemonProcess

LEASE_S = 1.5
ACK = log_pb2.PublishAck

PUBLISHER = """
import sys, time
from events.schema import BlockStored
from offloadd.client import IngestStream
s = IngestStream(sys.argv[1], sys.argv[2])
s.submit((BlockStored((1, 2), None, tuple(range(8)), 4, "GPU"),))
assert s.flush(10)
print("READY", flush=True)
time.sleep(600)
"""


@pytest.fixture
def daemon(tmp_path: Path, redis_url: str, namespace: str) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=16 * SLOT,
                         extra_args=("--engine-lease-s", str(LEASE_S)))
    proc.start()
    yield proc
    proc.kill()


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[OffloadClient]:
    with OffloadClient(daemon.target, retry=RetryPolicy(attempts=1)) as c:
        yield c


def batch(engine: str, seq: int, *hashes: int, incarnation: int = 1) -> events_pb2.EventBatch:
    return batch_to_proto(EventBatch(engine, incarnation, seq, time.time(), (
        BlockStored(hashes, None, tuple(range(4 * len(hashes))), 4, "GPU"),)))


def gpu_blocks(client: OffloadClient, engine: str) -> set[int]:
    return {h for s in client.snapshot().sources if s.source == engine
            for e in s.events if e.medium == "GPU" for h in e.block_hashes}


def clears(client: OffloadClient, engine: str) -> list[int]:
    """Offsets of the AllBlocksCleared records logged for ``engine`` by the daemon (unfenced,
    incarnation 0)."""
    return [r.offset for r in client.subscribe(1)
            if r.source == engine and r.incarnation == 0 and any(isinstance(e, AllBlocksCleared) for e in r.events)]


def wait_until_cleared(client: OffloadClient, engine: str, timeout_s: float) -> float:
    t0 = time.monotonic()
    while gpu_blocks(client, engine):
        assert time.monotonic() - t0 < timeout_s, f"{engine} still resident after {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def publish_and_close(daemon: DaemonProcess, *batches: events_pb2.EventBatch) -> list[log_pb2.PublishAck]:
    """One Publish stream that sends ``batches``, says it departs and half-closes: a clean end."""
    last = batches[-1]
    goodbye = events_pb2.EventBatch(engine_id=last.engine_id, incarnation=last.incarnation,
                                    departing=True)
    with grpc.insecure_channel(daemon.target) as ch:
        return list(log_pb2_grpc.EventIngestStub(ch).Publish(iter([*batches, goodbye]), timeout=10))


def test_half_close_without_goodbye_is_a_broken_stream(
    daemon: DaemonProcess, client: OffloadClient,
) -> None:
    """A sender that crashed can leave a half-close behind: only the goodbye clears at once."""
    with grpc.insecure_channel(daemon.target) as ch:
        acks = list(log_pb2_grpc.EventIngestStub(ch).Publish(iter([batch("quiet", 1, 41)]), timeout=10))
    assert [a.status for a in acks] == [ACK.STATUS_APPLIED]
    time.sleep(LEASE_S * 0.6)
    assert gpu_blocks(client, "quiet") == {41}
    wait_until_cleared(client, "quiet", LEASE_S * 2)


def test_clean_stream_end_clears_at_once_and_asks_for_a_resync(
    daemon: DaemonProcess, client: OffloadClient,
) -> None:
    acks = publish_and_close(daemon, batch("eng", 1, 11, 12), batch("eng", 2, 13))
    assert [a.status for a in acks] == [ACK.STATUS_APPLIED, ACK.STATUS_APPLIED], acks
    assert wait_until_cleared(client, "eng", LEASE_S / 2) < LEASE_S / 2  # not a lease
    assert len(clears(client, "eng")) == 1
    # Its tier is empty in the log now: more batches of the same incarnation would add to it
    # what the engine holds without saying so, so they get RESEND from 1 (IngestStream starts a
    # new incarnation and re-announces); a new incarnation applies.
    acks = publish_and_close(daemon, batch("eng", 2, 99), batch("eng", 3, 14))
    assert [(a.status, a.resend_from) for a in acks] == [(ACK.STATUS_RESEND, 1)] * 2
    acks = publish_and_close(daemon, batch("eng", 1, 14, incarnation=2))
    assert [a.status for a in acks] == [ACK.STATUS_APPLIED]
    wait_until_cleared(client, "eng", LEASE_S / 2)
    assert len(clears(client, "eng")) == 2
    # An engine without GPU blocks departs without an empty clear.
    acks = publish_and_close(daemon, batch("eng", 1, 15, incarnation=3), batch_to_proto(EventBatch(
        "eng", 3, 2, time.time(), (AllBlocksCleared("GPU"),))))
    assert [a.status for a in acks] == [ACK.STATUS_APPLIED] * 2
    time.sleep(0.5)
    assert len(clears(client, "eng")) == 2


def test_broken_stream_clears_after_the_lease(daemon: DaemonProcess, client: OffloadClient) -> None:
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, daemon.target, "crash"],
                            stdout=subprocess.PIPE, cwd=REPO)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"READY"
        assert gpu_blocks(client, "crash") == {1, 2}
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    time.sleep(LEASE_S * 0.6)
    assert gpu_blocks(client, "crash") == {1, 2}, "cleared before the lease ran out"
    wait_until_cleared(client, "crash", LEASE_S * 2)
    assert len(clears(client, "crash")) == 1


def test_reconnect_within_the_lease_keeps_the_blocks(
    daemon: DaemonProcess, client: OffloadClient,
) -> None:
    with grpc.insecure_channel(daemon.target) as ch:
        call = log_pb2_grpc.EventIngestStub(ch).Publish(_then_block(batch("blip", 1, 21)))
        assert next(call).status == ACK.STATUS_APPLIED
        call.cancel()  # broken before the client half-closed, as a lost connection
    time.sleep(LEASE_S / 3)
    stream = IngestStream(daemon.target, "blip")  # idle: its header alone says who it is
    try:
        time.sleep(LEASE_S * 1.5)
        assert gpu_blocks(client, "blip") == {21}
        assert clears(client, "blip") == []
    finally:
        stream.close()


def _then_block(first: events_pb2.EventBatch) -> Iterator[events_pb2.EventBatch]:
    yield first
    time.sleep(30)  # the stream stays open (grpc runs this on its own thread)


def test_stop_is_quick_with_streams_open_and_clears_nobody(
    daemon: DaemonProcess, client: OffloadClient,
) -> None:
    stream = IngestStream(daemon.target, "stay", backoff_s=(0.05, 0.2))  # back within the lease
    try:
        stream.submit((BlockStored((31,), None, (1, 2, 3, 4), 4, "GPU"),))
        assert stream.flush(10)
        follower = client.subscribe(1, follow=True)
        next(follower)
        assert daemon.proc is not None
        t0 = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        rc = daemon.proc.wait(timeout=15)
        took = time.monotonic() - t0
        assert rc == 0, daemon.log_tail()
        assert took < 2.0, f"stop took {took:.1f} s"
        daemon.proc = None
        # The restarted daemon still holds the engine's blocks; it reconnects and keeps them.
        daemon.restart()
        with OffloadClient(daemon.target, retry=RetryPolicy(attempts=1)) as fresh:
            assert gpu_blocks(fresh, "stay") == {31}
            time.sleep(LEASE_S * 1.5)
            assert gpu_blocks(fresh, "stay") == {31}
            assert clears(fresh, "stay") == []
            stream.close()  # it departs: it says goodbye, cleared at once
            assert wait_until_cleared(fresh, "stay", LEASE_S * 3) < LEASE_S / 2
    finally:
        stream.close()


def test_an_engine_back_after_its_lease_re_announces(
    daemon: DaemonProcess, client: OffloadClient, tmp_path: Path,
) -> None:
    """The attack run's finding: a daemon restarted under a live engine leased it, the engine
    came back after the lease (its reconnect backoff was longer), was cleared, and went on
    publishing on top of a tier the log said was empty. Now its next batch gets RESEND from 1:
    it starts a new incarnation and re-announces, and the log holds what it holds.

    The engine reaches the daemon through a link to its unix socket that the test cuts while
    the daemon restarts and mends once the lease ran out: late for sure, however long the
    restart takes (with a backoff alone, a slow restart let it back within the lease)."""
    gate = tmp_path / "gate.sock"
    gate.symlink_to(daemon.unix_socket)
    held: set[int] = set()
    resets: list[int] = []
    stream = IngestStream(f"unix:{gate}", "late", on_reset=resets.append)
    try:
        def store(h: int) -> None:
            held.add(h)
            stream.submit((BlockStored((h,), None, (1, 2, 3, 4), 4, "GPU"),))

        store(51)
        store(52)
        assert stream.flush(10)
        gate.unlink()
        gate.symlink_to(tmp_path / "nowhere.sock")  # the engine cannot reach any daemon now
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(timeout=15) == 0
        daemon.proc = None
        daemon.restart()  # every engine with GPU blocks is on a lease now; "late" cannot answer
        wait_until_cleared(client, "late", 30)
        assert not stream.is_connected
        gate.unlink()
        gate.symlink_to(daemon.unix_socket)  # back after its lease
        store(53)
        deadline = time.monotonic() + 30  # gRPC's own reconnect backoff grew while it was out
        while not resets and time.monotonic() < deadline:
            time.sleep(0.05)
        assert resets, "the engine was never asked to re-announce"
        stream.resync([BlockStored((h,), None, (1, 2, 3, 4), 4, "GPU") for h in sorted(held)])
        assert stream.flush(10)
        assert gpu_blocks(client, "late") == held
    finally:
        stream.close()
