"""A publisher's replay ring, as kv-ingest asks it: the request, and what the answer says about
continuity (ingest.follower's rules)."""

from __future__ import annotations

from collections.abc import Callable

import zmq

from events.replay_socket import ReplaySocket, ReplyTimeout
from events.wire_frames import seq_bytes
from ingest.errors import Garbage
from ingest.wire import Frame, parse_reply


class ReplayClient:
    """kv-ingest's side of a vLLM publisher's replay socket (events.replay_socket): replies
    parsed with ingest.wire's tolerance, garbage counted, a timeout an answer of None."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, timeout_s: float,
                 on_garbage: Callable[[Garbage], None]) -> None:
        self._ctx = ctx
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._on_garbage = on_garbage
        self._sock: ReplaySocket | None = None  # connected at the first request

    def replay_from(self, start: int) -> list[Frame] | None:
        """Every batch the ring holds from ``start``; None when the publisher does not answer
        within ``timeout_s`` (between two messages)."""
        if self._sock is None:
            self._sock = ReplaySocket(self._ctx, self.endpoint, self.timeout_s)
        out: list[Frame] = []
        try:
            for message in self._sock.answer(seq_bytes(start), per_message=True):
                try:
                    frame = parse_reply(message)
                except Garbage as exc:
                    self._on_garbage(exc)
                    continue
                if frame is None:
                    return out
                out.append(frame)
        except ReplyTimeout:
            pass
        return None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


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
