"""ZMQ frame layouts of the vLLM KV-event protocol (WIRE.md) and our snapshot extension.

Live: ``[topic, seq, payload]``. Replay request (ROUTER side): ``[identity, b"", start_seq]``,
reply ``[identity, b"", topic, seq, payload]`` per batch then ``[identity, b"", b"", END, b""]``.
Snapshot: the request body is ``b"snapshot"``; the snapshot's batches carry their index within
the snapshot as seq (they are not part of the live numbering) and the end marker
``[identity, b"", b"", next_seq, b""]`` carries in its middle frame the live seq to continue
from. A client therefore recognises the end of any reply by its empty payload frame (a real
batch is never empty), and reads the seq frame only after a snapshot request.

Extension for a bridge publishing several topics on one socket (per-source mode): a request
may carry the topic as one more frame, ``[identity, b"", start_seq | b"snapshot", topic]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from events.errors import EventsError

SEQ_BYTES: Final[int] = 8
END_SEQ: Final[bytes] = b"\xff" * SEQ_BYTES
MAX_SEQ: Final[int] = 2**64 - 2  # 2**64 - 1 is the end marker
SNAPSHOT: Final[bytes] = b"snapshot"


def seq_bytes(seq: int) -> bytes:
    if not 0 <= seq <= MAX_SEQ:
        raise ValueError(f"seq {seq} out of range")
    return seq.to_bytes(SEQ_BYTES, "big")


def seq_value(frame: bytes) -> int:
    """Decode a seq frame; ValueError when it is not 8 bytes."""
    if len(frame) != SEQ_BYTES:
        raise ValueError(f"seq frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


class BadRequest(EventsError, ValueError):
    """A replay/snapshot request that does not follow WIRE.md; it is logged and ignored."""


@dataclass(frozen=True)
class ReplayRequest:
    """``start_seq`` is None for a snapshot request; ``topic`` only with the extension frame."""

    identity: bytes
    start_seq: int | None
    topic: bytes | None = None


def parse_request(frames: list[bytes]) -> ReplayRequest:
    """Parse what a ROUTER socket received: ``[identity, b"", body(, topic)]``."""
    if len(frames) not in (3, 4):
        raise BadRequest(f"expected 3 or 4 frames, got {len(frames)}")
    identity, delimiter, body = frames[0], frames[1], frames[2]
    if delimiter != b"":
        raise BadRequest(f"expected an empty delimiter frame, got {len(delimiter)} bytes")
    topic = frames[3] if len(frames) == 4 else None
    if body == SNAPSHOT:
        return ReplayRequest(identity, None, topic)
    if len(body) != SEQ_BYTES:
        raise BadRequest(f"start_seq must be {SEQ_BYTES} bytes, got {len(body)}")
    start = int.from_bytes(body, "big")
    if start > MAX_SEQ:
        raise BadRequest("start_seq is the end marker")
    return ReplayRequest(identity, start, topic)
