"""vLLM's own fields survive the whole way: a vLLM 0.33 publisher's bytes -> kv-ingest ->
offloadd's log -> kv-bridge -> a stock vLLM decoder reads them back equal."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from events.schema import BlockRemoved, BlockStored
from ingest.vllm_publisher import VllmStylePublisher
from offloadd.client import OffloadClient
from tests.events.vllm_schema import KVEventBatch, VBlockRemoved, VBlockStored
from tests.ingest.conftest import records, wait_for
from tests.support.bridge_proc import BridgeProcess
from tests.support.ingest_proc import IngestProcess, vllm_endpoints
from tests.support.offloadd_proc import DaemonProcess

SENT = [
    VBlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(8)),
                 block_size=4, lora_id=None, medium="GPU", lora_name="adapter-1",
                 extra_keys=[["adapter-1", "salt-x"], ["adapter-1"]], locality="LOCAL"),
    VBlockStored(block_hashes=[21], parent_block_hash=None, token_ids=[5, 6, 7, 8], block_size=4,
                 lora_id=None, medium="GPU", lora_name=None, group_idx=1,
                 kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128),
    VBlockStored(block_hashes=[11], parent_block_hash=None, token_ids=[0, 1, 2, 3], block_size=4,
                 lora_id=None, medium="CPU", lora_name="adapter-1",
                 extra_keys=[["adapter-1", "salt-x"]]),  # vLLM's own CPU offloading
    VBlockRemoved(block_hashes=[21], medium="GPU", group_idx=1),
]
KEPT = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")


def _fields(event: object) -> dict[str, object]:
    return {k: getattr(event, k, None) for k in KEPT}


def _replay_all(endpoint: str) -> list[bytes]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    payloads = []
    try:
        while dealer.poll(5000):
            _empty, _topic, _seq, payload = dealer.recv_multipart()
            if payload == b"":
                break
            payloads.append(payload)
    finally:
        ctx.destroy(linger=0)
    return payloads


def test_vllm_fields_are_logged_and_republished_unchanged(
    tmp_path: Path, redis_url: str, daemon: DaemonProcess, client: OffloadClient,
    publishers: list[VllmStylePublisher], start_ingest: Callable[..., IngestProcess],
) -> None:
    pub, replay = vllm_endpoints()
    vllm = VllmStylePublisher(pub, replay)
    publishers.append(vllm)
    encoder = msgspec.msgpack.Encoder()
    for event in SENT:  # one batch per event, encoded by vLLM's own structs
        vllm.publish_payload(encoder.encode(KVEventBatch(ts=time.time(), events=[event],
                                                        data_parallel_rank=0)))
    start_ingest(f"vllm-0={pub},replay={replay}")
    wait_for(lambda: sum(len(r.events) for r in records(client)) == len(SENT),
             what="the batches in the log")

    logged = [e for r in records(client) for e in r.events]  # batches waiting together: one record
    assert all(r.source == "vllm-0" for r in records(client))
    first, window, cpu, removed = logged
    assert isinstance(first, BlockStored) and first.lora_name == "adapter-1"
    assert first.extra_keys == (("adapter-1", "salt-x"), ("adapter-1",))
    assert isinstance(window, BlockStored)
    assert (window.group_idx, window.kv_cache_spec_kind, window.sliding_window) == (1, "sliding_window", 128)
    assert isinstance(cpu, BlockStored) and cpu.medium == "CPU"  # the source's own CPU tier
    assert removed == BlockRemoved((21,), "GPU", 1)

    bridge = BridgeProcess(redis_url, tmp_path / "bridge", "--start", "beginning",
                           namespace=daemon.namespace)
    bridge.start()
    try:
        payloads = _replay_all(bridge.replay)
    finally:
        bridge.stop()
    decoder = msgspec.msgpack.Decoder(KVEventBatch)  # a stock vLLM 0.33 consumer's schema
    got = [e for p in payloads for e in decoder.decode(p).events]
    assert [_fields(e) for e in got] == [_fields(e) for e in SENT]
