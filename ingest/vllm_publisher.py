"""A vLLM-style KV-event publisher written from WIRE.md, for the demo, the tests and the bench.

It behaves as vLLM's ``ZmqEventPublisher`` does: a PUB socket sends ``[topic, seq, payload]``
with seq from 0 per publisher life; a ROUTER socket answers ``[identity, b"", start_seq]`` with
every batch of its ring (the last ``ring_size``) from ``start_seq`` on, as
``[identity, b"", topic, seq, payload]`` (``[identity, b"", seq, payload]`` with
``reply_topic=False``, as vLLM before 0.33 answers), then the end marker
``[identity, b"", b"", ff*8, b""]``. Requests of another shape are ignored, as vLLM ignores them.

For fault tests: ``publish(..., drop=True)`` numbers and keeps a batch without sending it (a
message lost on the way), and :meth:`send_frames` sends anything at all.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from events.codec_vllm import encode_batch
from events.schema import Event
from events.wire_frames import END_SEQ, seq_bytes


class VllmStylePublisher:
    def __init__(
        self, pub_endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
        ring_size: int = 10_000, reply_topic: bool = True, dp_rank: int = 0,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self.reply_topic = reply_topic
        self.next_seq = 0
        self.num_replays = 0
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=ring_size)
        self._lock = threading.Lock()
        self._own_ctx = ctx is None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = ctx or zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)  # vLLM's default hwm
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(pub_endpoint)
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        if replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, 0)
            router.bind(replay_endpoint)
            self._replay_thread = threading.Thread(target=self._serve, args=(router,),
                                                   name="vllm-replay", daemon=True)
            self._replay_thread.start()

    def publish(self, events: Sequence[Event], *, drop: bool = False) -> int:
        """One batch of domain events in vLLM's map layout; returns its seq."""
        return self.publish_payload(encode_batch(events, time.time(), dp_rank=self.dp_rank), drop=drop)

    def publish_payload(self, payload: bytes, *, drop: bool = False) -> int:
        with self._lock:
            seq = self.next_seq
            self.next_seq += 1
            self._ring.append((seq, payload))
        if not drop:
            self._pub.send_multipart([self.topic, seq_bytes(seq), payload])
        return seq

    def send_frames(self, frames: Sequence[bytes]) -> None:
        self._pub.send_multipart(list(frames))

    def close(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=5)
        self._pub.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    def _serve(self, router: zmq.Socket[bytes]) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(20, zmq.POLLIN):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue  # vLLM logs "Invalid replay request" and carries on
                identity, start = frames[0], int.from_bytes(frames[2], "big")
                with self._lock:
                    batches = [(s, p) for s, p in self._ring if s >= start]
                self.num_replays += 1
                head = [identity, b"", self.topic] if self.reply_topic else [identity, b""]
                for seq, payload in batches:
                    router.send_multipart([*head, seq_bytes(seq), payload])
                router.send_multipart([*head[:2], b"", END_SEQ, b""] if self.reply_topic
                                      else [identity, b"", END_SEQ, b""])
        finally:
            router.close(linger=0)
