"""A publisher's replay ring, as kv-ingest asks it: the request, and what the answer says about
continuity (ingest.follower's rules)."""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from events.wire_frames import seq_bytes
from ingest.errors import Garbage
from ingest.wire import Frame, parse_reply


class ReplayClient:
    """A DEALER speaking REQ's envelope (a REQ socket would accept only the first message of a
    reply; vLLM's own publisher answers with many)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, timeout_s: float,
                 on_garbage: Callable[[Garbage], None]) -> None:
        self._ctx = ctx
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._on_garbage = on_garbage
        self._dealer: zmq.Socket[bytes] | None = None
        self.last_answer = time.monotonic()

    def replay_from(self, start: int) -> list[Frame] | None:
        """Every batch the ring holds from ``start``; None when the publisher does not answer
        within ``timeout_s`` (between two messages)."""
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.setsockopt(zmq.RCVHWM, 0)
            self._dealer.connect(self.endpoint)
        dealer = self._dealer
        dealer.send_multipart([b"", seq_bytes(start)])
        out: list[Frame] = []
        while dealer.poll(int(self.timeout_s * 1000), zmq.POLLIN):
            try:
                frame = parse_reply(dealer.recv_multipart())
            except Garbage as exc:
                self._on_garbage(exc)
                continue
            if frame is None:
                self.last_answer = time.monotonic()
                return out
            out.append(frame)
        # A late answer would be taken for the next one's: start on a fresh socket.
        self.close()
        return None

    def close(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None


def continuity(next_seq: int, anchor: int, anchor_digest: int | None, frames: list[Frame]) -> str:
    """"" when ``frames`` (a replay from ``anchor``) continue the life followed up to
    ``next_seq``; else why not: a restart or a lost gap."""
    if anchor < next_seq:
        for frame in frames:
            if frame.seq == anchor:
                same = hash(frame.payload) == anchor_digest
                return "" if same else "publisher restarted (other content at a seq)"
    if not frames:
        return "publisher restarted (its ring ends before our seq)" if anchor < next_seq else ""
    first = frames[0].seq
    if first > next_seq:
        return "ring no longer holds the gap"
    if first < anchor:
        return "publisher restarted (replay before the seq asked)"
    return ""
