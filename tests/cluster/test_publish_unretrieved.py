"""A Publish stream that ends (the engine gives up and reconnects, as engines do while Redis fails
over) with appends of its batches still in flight: those appends fail after the stream is gone.
Their answers must not be reported as "Future exception was never retrieved" (the daemon's log
filled with them during failovers)."""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from kvcache.v1 import events_pb2, log_pb2_grpc

from events.codec_proto import EventBatch, batch_to_proto
from events.schema import BlockStored
from offloadd.client import OffloadClient
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_proc import RedisProcess

N = 50


def _batch(seq: int) -> events_pb2.EventBatch:
    event = BlockStored((seq,), seq - 1 if seq > 1 else None, (1, 2, 3, 4), 4, "GPU")
    return batch_to_proto(EventBatch("e", 1, seq, time.time(), (event,)))


def test_acks_of_a_stream_that_left_are_not_leaked(tmp_path: Path, own_redis: RedisProcess) -> None:
    daemon = DaemonProcess(tmp_path / "d", own_redis.url, "leak", extra_args=("--owner-lease-s", "30"))
    daemon.start()
    assert own_redis.proc is not None
    outbox: queue.Queue[events_pb2.EventBatch | None] = queue.Queue()

    def requests() -> Iterator[events_pb2.EventBatch]:
        while (msg := outbox.get()) is not None:
            yield msg

    try:
        with grpc.insecure_channel(daemon.target) as ch:
            call = log_pb2_grpc.EventIngestStub(ch).Publish(requests(), timeout=30)
            outbox.put(_batch(1))
            assert next(call).acked_seq == 1
            os.kill(own_redis.proc.pid, signal.SIGSTOP)  # Redis hangs, as a primary that died
            try:
                for seq in range(2, N + 2):
                    outbox.put(_batch(seq))
                time.sleep(0.3)  # the daemon has them all in flight
                call.cancel()  # the engine gives up on this stream
                outbox.put(None)
                time.sleep(1.5)  # past --redis-timeout-s: the appends in flight fail
            finally:
                os.kill(own_redis.proc.pid, signal.SIGCONT)
        with OffloadClient(daemon.target) as client:  # work that lets the collector run
            for _ in range(500):
                client.stats()
        assert daemon.proc is not None and daemon.proc.poll() is None
        text = daemon.log_path.read_text()
        assert "exception was never retrieved" not in text, text[-3000:]
    finally:
        outbox.put(None)
        daemon.kill()
