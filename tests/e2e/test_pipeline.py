"""vLLM's publisher test shape through the whole path, at small scale and untimed: batches of 100
single-hash BlockStored on one EventIngest stream -> offloadd -> Redis -> kv-bridge -> a ZMQ SUB.
Nothing is lost, the published seq is contiguous, and every block arrives once, in order.
(bench/bench_pipeline.py runs the same at full scale and reports the rate.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import zmq
from kvcache.v1 import log_pb2, log_pb2_grpc

from events.codec_proto import EventBatch, batch_to_proto
from events.codec_vllm import decode_batch
from events.schema import BlockStored
from tests.support.bridge_proc import BridgeProcess
from tests.support.offloadd_proc import DaemonProcess

BATCHES, PER_BATCH, BLOCK_SIZE = 300, 100, 16


def _batches() -> Iterator[object]:
    for i in range(BATCHES):
        events = tuple(BlockStored((i * PER_BATCH + j + 1,), None, tuple(range(BLOCK_SIZE)),
                                   BLOCK_SIZE, "GPU") for j in range(PER_BATCH))
        yield batch_to_proto(EventBatch("vllm-shape", 1, i + 1, time.time(), events))


def test_vllm_publisher_shape_end_to_end_loses_nothing(tmp_path: Path, redis_url: str) -> None:
    daemon = DaemonProcess(tmp_path / "d", redis_url, "pipeline")
    daemon.start()
    bridge = BridgeProcess(redis_url, tmp_path / "bridge", namespace="pipeline")
    bridge.start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(bridge.pub)
    time.sleep(0.5)  # the subscription reaches the bridge
    try:
        with grpc.insecure_channel(daemon.target) as ch:
            acks = list(log_pb2_grpc.EventIngestStub(ch).Publish(_batches(), timeout=120))
        assert [a.status for a in acks] == [log_pb2.PublishAck.STATUS_APPLIED] * BATCHES
        seqs, hashes = [], []
        while len(seqs) < BATCHES and sub.poll(10_000):
            _, seq, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            for event in decode_batch(payload).events:
                assert isinstance(event, BlockStored)
                hashes.extend(event.block_hashes)
    finally:
        ctx.destroy(linger=0)
        bridge.stop()
        daemon.stop()
    assert len(seqs) == BATCHES, f"received {len(seqs)} of {BATCHES} batches"
    assert seqs == list(range(seqs[0], seqs[0] + BATCHES))
    assert hashes == list(range(1, BATCHES * PER_BATCH + 1))
