"""The client side of a replay socket (events.wire_frames, WIRE.md), a kv-bridge's or a vLLM
publisher's: a request for the batches from a seq or for a snapshot, and its answer read up to
the end marker.

A DEALER speaking REQ's envelope (a REQ socket would accept only the first message of a reply,
and the answer has many). One request at a time, within ``timeout_s`` for the whole answer (or,
``per_message``, between two of its messages). When the answer does not come in time the DEALER
is replaced: a late answer would otherwise be taken for the next request's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import zmq

from events.errors import EventsError

Batch = tuple[bytes, bytes, bytes]
"""``(topic, seq frame, payload)`` of one batch of an answer."""


class SubscriberError(EventsError):
    """The bridge did not answer a replay or snapshot request in time, or refused it."""


class ReplyTimeout(SubscriberError):
    """No complete answer in time."""


class EndpointError(SubscriberError, ValueError):
    """An endpoint ZMQ cannot connect to (a typo, a missing scheme)."""


def connect(sock: zmq.Socket[bytes], endpoint: str) -> None:
    """``sock.connect(endpoint)``; EndpointError, naming the forms, when ZMQ refuses it."""
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        raise EndpointError(f"cannot connect to {endpoint!r}: {exc.strerror} (expected tcp://HOST:PORT, "
                            "ipc://PATH or inproc://NAME)") from None


class ReplaySocket:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, timeout_s: float) -> None:
        self._ctx = ctx
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._dealer = self._connect()

    def _connect(self) -> zmq.Socket[bytes]:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)
        try:
            connect(dealer, self.endpoint)
        except EndpointError:
            dealer.close(linger=0)
            raise
        return dealer

    def request(self, body: bytes) -> tuple[list[Batch], bytes]:
        """Send ``body`` (a seq frame or ``SNAPSHOT``) to a bridge; return the batches and the end
        marker's seq frame. SubscriberError when the bridge refuses it or the answer is not
        complete in time."""
        out: list[Batch] = []
        for frames in self.answer(body):
            if len(frames) != 4 or frames[0] != b"":
                continue
            _empty, topic, seq_frame, payload = frames
            if payload == b"":
                if topic.startswith(b"error:"):  # the bridge's answer to a request for no stream
                    raise SubscriberError(f"{self.endpoint}: {topic.decode(errors='replace')}")
                return out, seq_frame
            out.append((topic, seq_frame, payload))
        raise AssertionError("answer() ends only by raising")  # pragma: no cover

    def answer(self, body: bytes, *, per_message: bool = False) -> Iterator[list[bytes]]:
        """Send ``body``; yield each message of the answer as received (the envelope's empty frame
        first) until the caller has read its end. ReplyTimeout, the DEALER replaced, when the
        whole answer (``per_message``: the next message) does not come within ``timeout_s``."""
        self._dealer.send_multipart([b"", body])
        deadline = time.monotonic() + self.timeout_s
        while True:
            if per_message:
                deadline = time.monotonic() + self.timeout_s
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._dealer.poll(left_ms, zmq.POLLIN):
                self._dealer.close()
                self._dealer = self._connect()
                raise ReplyTimeout(f"no complete reply from {self.endpoint} in time")
            yield self._dealer.recv_multipart()

    def close(self) -> None:
        self._dealer.close(linger=0)
