"""events.subscriber: prefix queries over a real bridge, and gap handling against a scripted
publisher that follows WIRE.md (PUB + ROUTER), so a loss can be produced exactly."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import zmq

from events.codec_vllm import encode_batch
from events.extra_keys import MultiModalItem, RequestKeys
from events.hashing import BlockHasher, to_wire
from events.schema import BlockRemoved, BlockStored, Event
from events.state import PrefixMatch
from events.subscriber import KvEventSubscriber, SubscriberError
from events.wire_frames import END_SEQ, parse_request, seq_bytes
from tests.support.bridge_proc import BridgeProcess, LogWriter
from tests.support.redis_proc import free_port


def test_longest_prefix_per_source_through_the_bridge(redis_url: str, tmp_path: Path) -> None:
    hasher = BlockHasher(seed="0", block_size=4)
    prompt = list(range(100, 124))  # 6 full blocks
    hashes = tuple(to_wire(d) for d in hasher.hash_blocks(prompt))
    client = redis.Redis.from_url(redis_url)
    writer = LogWriter(client)
    writer.append("engine-a", [BlockStored(hashes[:3], None, tuple(prompt[:12]), 4, "GPU")])
    writer.append("offloadd", [BlockStored(hashes[:5], None, tuple(prompt[:20]), 4, "CPU")])
    writer.append("engine-b", [BlockStored(hashes[:2], None, tuple(prompt[:8]), 4, "GPU"),
                               BlockStored(hashes[:4], None, tuple(prompt[:16]), 4, "CPU")])
    bridge = BridgeProcess(redis_url, tmp_path)
    bridge.start()
    try:
        with KvEventSubscriber(bridge.pub, bridge.replay) as sub:
            assert sub.bootstrap() == 3
            assert sub.longest_prefix(prompt, hasher) == {
                "engine-a": PrefixMatch(3, 3, 0, 3.0),
                "offloadd": PrefixMatch(5, 0, 5, 4.0),
                "engine-b": PrefixMatch(4, 2, 2, 1.0 + 1.0 + 0.8 + 0.8),
            }
            writer.append("engine-a", [BlockRemoved((hashes[2],), "GPU")])
            assert sub.run_until(lambda s: s.next_seq == 4)
            assert sub.longest_prefix(prompt, hasher)["engine-a"] == PrefixMatch(2, 2, 0, 2.0)
            assert sub.longest_prefix(prompt[:3], hasher) == {}  # no full block
    finally:
        bridge.stop()
        client.close()


class ScriptedPublisher:
    """A WIRE.md peer: publishes chosen seqs and serves replay from a fixed batch list."""

    def __init__(self, batches: list[bytes], topic: bytes = b"t") -> None:
        self.topic = topic
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.pub.bind(self.pub_endpoint)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.router.bind(self.replay_endpoint)
        self.batches = batches
        self.requests: list[int | None] = []
        self.serving = True
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(20):
                continue
            req = parse_request(self.router.recv_multipart())
            self.requests.append(req.start_seq)
            if not self.serving or req.start_seq is None:
                continue
            for seq in range(req.start_seq, len(self.batches)):
                self.router.send_multipart([req.identity, b"", self.topic, seq_bytes(seq), self.batches[seq]])
            self.router.send_multipart([req.identity, b"", b"", END_SEQ, b""])

    def publish(self, seq: int) -> None:
        self.pub.send_multipart([self.topic, seq_bytes(seq), self.batches[seq]])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.ctx.destroy(linger=0)


def _batch(h: int, source: str | None = None) -> bytes:
    events: list[Event] = [BlockStored((h,), None, (1, 2), 2, "GPU")]
    return encode_batch(events, 1.0, source=source)


@pytest.fixture
def peer() -> Iterator[ScriptedPublisher]:
    p = ScriptedPublisher([_batch(h) for h in range(10, 20)])
    yield p
    p.close()


def _joined(sub: KvEventSubscriber, peer: ScriptedPublisher) -> None:
    """Publish seq 0 until the SUB gets it (PUB drops messages sent before the join)."""
    for _ in range(100):
        peer.publish(0)
        if sub.poll(50):
            return
    raise AssertionError("never joined")


def test_gap_is_filled_by_replay_and_duplicates_dropped(peer: ScriptedPublisher) -> None:
    with KvEventSubscriber(peer.pub_endpoint, peer.replay_endpoint, "t", idle_sync_s=None) as sub:
        _joined(sub, peer)
        peer.publish(1)
        peer.publish(4)  # 2 and 3 lost
        peer.publish(1)  # late duplicate
        assert sub.run_until(lambda s: s.next_seq is not None and s.next_seq >= 10)
        assert sub.stats.gaps == 1 and sub.stats.lost == 0
        assert peer.requests == [2]  # one replay from the first missing seq
        assert sub.stats.duplicates >= 1
        assert sub.view() == {("t", "GPU", 0): frozenset(range(10, 20))}  # no source key: topic


def test_unfillable_gap_is_counted_as_lost(peer: ScriptedPublisher) -> None:
    peer.serving = False
    with KvEventSubscriber(peer.pub_endpoint, peer.replay_endpoint, "t", idle_sync_s=None,
                           replay_timeout_s=0.3, default_source="e") as sub:
        _joined(sub, peer)
        peer.publish(3)
        assert sub.run_until(lambda s: s.next_seq == 4)
        assert (sub.stats.gaps, sub.stats.lost) == (1, 2)
        assert sub.view() == {("e", "GPU", 0): frozenset({10, 13})}
        with pytest.raises(SubscriberError, match="no complete reply"):
            sub.bootstrap()


def test_malformed_live_messages_are_dropped(peer: ScriptedPublisher) -> None:
    with KvEventSubscriber(peer.pub_endpoint, peer.replay_endpoint, "t", idle_sync_s=None) as sub:
        _joined(sub, peer)
        peer.pub.send_multipart([b"t", b"short", b"x"])
        peer.pub.send_multipart([b"t", seq_bytes(1), b"\xc1 not msgpack"])
        peer.publish(2)
        assert sub.run_until(lambda s: s.next_seq == 3)
        assert sub.stats.malformed == 2
        assert sub.view() == {("t", "GPU", 0): frozenset({10, 12})}


@pytest.mark.parametrize("topic", [b"", b"kv-events"])
def test_default_topic_takes_vllms_and_ours(topic: bytes) -> None:
    """vLLM's publishers default to topic "", the bridge to "kv-events": both are followed."""
    peer = ScriptedPublisher([_batch(h) for h in range(10, 13)], topic=topic)
    try:
        with KvEventSubscriber(peer.pub_endpoint, peer.replay_endpoint, idle_sync_s=None) as sub:
            _joined(sub, peer)
            peer.pub.send_multipart([b"kv-events/other", seq_bytes(1), peer.batches[1]])
            peer.publish(2)  # seq 1 missing on our topics: filled by replay
            assert sub.run_until(lambda s: s.next_seq == 3)
            assert sub.stats.other_topics == 1 and sub.stats.gaps == 1
            assert sub.view() == {("kv-events", "GPU", 0): frozenset({10, 11, 12})}
    finally:
        peer.close()


def test_longest_prefix_with_vllm_extra_keys() -> None:
    """A vLLM engine's blocks of a salted LoRA request with an image match only with its keys."""
    hasher = BlockHasher(block_size=2)
    prompt = list(range(1, 9))  # 4 blocks; an image on tokens 2-4
    keys = RequestKeys(lora_name="sql", lora_path="/a/sql", cache_salt="t1",
                       mm_items=(MultiModalItem("img0", 2, 3),))
    hashes = tuple(to_wire(d) for d in hasher.hash_request(prompt, keys))
    stored = encode_batch([BlockStored(hashes, None, tuple(prompt), 2, "GPU")], 1.0)
    peer = ScriptedPublisher([stored], topic=b"")
    try:
        with KvEventSubscriber(peer.pub_endpoint, peer.replay_endpoint, idle_sync_s=None,
                               default_source="vllm-0") as sub:
            _joined(sub, peer)
            assert sub.longest_prefix(prompt, hasher, keys=keys) == {"vllm-0": PrefixMatch(4, 4, 0, 4.0)}
            assert sub.longest_prefix(prompt, hasher) == {}
            other_salt = RequestKeys(lora_name="sql", lora_path="/a/sql", cache_salt="t2",
                                     mm_items=keys.mm_items)
            assert sub.longest_prefix(prompt, hasher, keys=other_salt) == {}
            with pytest.raises(ValueError, match="not both"):
                sub.longest_prefix(prompt, hasher, extra_keys=("x",), keys=keys)
    finally:
        peer.close()
