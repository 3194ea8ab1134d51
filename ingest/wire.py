"""What a vLLM publisher sends, as kv-ingest reads it: live frames, replay replies, payloads.

The layouts are WIRE.md's (events.wire_frames, events.codec_vllm); this module adds the
tolerance a follower of real engines needs, each case counted by the caller:

- a replay reply with the topic frame (vLLM 0.33, our bridge: ``[b"", topic, seq, payload]``)
  or without it (older vLLM: ``[b"", seq, payload]``); the end marker has an empty payload;
- a seq frame of 8 bytes, or 24 (the seq then a 16-byte publisher identity, as a snapshot-enabled
  vLLM publisher sends it: a new identity is a new publisher life);
- a batch encoded as an array (WIRE.md) or as a map (``ts``/``events``/``data_parallel_rank``);
- an event whose ``medium`` is nil is taken as "GPU" (vLLM's default medium); an event of a
  medium the log has no tier for ("STORAGE") is left out and counted (``num_skipped``).
Anything else is :class:`ingest.errors.Garbage`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import msgspec

from events.codec_vllm import decode_batch
from events.schema import MEDIA, Event, SchemaError
from events.wire_frames import END_SEQ, SEQ_BYTES
from ingest.errors import Garbage

_IDENTITY_BYTES: Final = 16
_ANY: Final = msgspec.msgpack.Decoder()
_ENCODER: Final = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class Frame:
    """One batch as sent: its seq, the publisher identity when the seq frame carries one."""

    seq: int
    payload: bytes
    publisher_id: bytes = b""


@dataclass(frozen=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int
    num_skipped: int = 0  # events of a medium the log has no tier for


def parse_seq(frame: bytes) -> tuple[int, bytes]:
    if len(frame) not in (SEQ_BYTES, SEQ_BYTES + _IDENTITY_BYTES):
        raise Garbage("seq_frame", f"seq frame of {len(frame)} bytes")
    seq_part = frame[:SEQ_BYTES]
    if seq_part == END_SEQ:
        raise Garbage("seq_frame", "end marker on the live stream")
    return int.from_bytes(seq_part, "big"), frame[SEQ_BYTES:]


def parse_live(frames: list[bytes], topic: bytes) -> Frame:
    """``[topic, seq, payload]`` from the SUB socket."""
    if len(frames) != 3:
        raise Garbage("frame_count", f"{len(frames)} frames, expected 3")
    if frames[0] != topic:
        raise Garbage("topic", f"topic {frames[0][:64]!r}, expected {topic!r}")
    seq, publisher_id = parse_seq(frames[1])
    return Frame(seq, frames[2], publisher_id)


def parse_reply(frames: list[bytes]) -> Frame | None:
    """One message a DEALER received for a replay request; None for the end marker."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise Garbage("replay_reply", f"{len(frames)} frames")
    seq_frame, payload = frames[-2], frames[-1]
    if payload == b"":
        return None
    seq, publisher_id = parse_seq(seq_frame)
    return Frame(seq, payload, publisher_id)


def decode(payload: bytes) -> Batch:
    """A payload as a Batch; Garbage("payload") when it is not a batch kv-ingest can log."""
    try:
        wire = decode_batch(payload)  # the common case: WIRE.md's layout exactly
        return Batch(wire.ts, wire.events, wire.dp_rank)
    except SchemaError as exc:
        first = exc
    try:
        normal, skipped = _normalise(_ANY.decode(payload))
        wire = decode_batch(_ENCODER.encode(normal))
    except (msgspec.DecodeError, SchemaError, ValueError, TypeError) as exc:
        raise Garbage("payload", str(first if isinstance(exc, msgspec.DecodeError) else exc)) from None
    return Batch(wire.ts, wire.events, wire.dp_rank, skipped)


def _normalise(value: Any) -> tuple[list[Any], int]:
    """An array batch with nil media made "GPU" and events of other media left out."""
    if isinstance(value, dict):
        value = [value.get("ts"), value.get("events"), value.get("data_parallel_rank")]
    if not isinstance(value, list) or len(value) < 2 or not isinstance(value[1], list):
        raise ValueError("not a batch: expected [ts, events, data_parallel_rank]")
    kept: list[Any] = []
    for event in value[1]:
        medium_at = _medium_index(event)
        if medium_at is None:
            kept.append(event)
            continue
        medium = event[medium_at]
        if medium is None:
            event[medium_at] = "GPU"
        elif medium not in MEDIA:
            continue
        kept.append(event)
    return [value[0], kept, *value[2:3]], len(value[1]) - len(kept)


def _medium_index(event: Any) -> Any:
    """Where the event keeps its medium (a map key or an array position); None if nowhere."""
    if isinstance(event, dict):
        return "medium" if "medium" in event and event.get("type") != "AllBlocksCleared" else None
    if isinstance(event, list) and event:
        position = {"BlockStored": 6, "BlockRemoved": 2}.get(event[0])
        if position is not None and len(event) > position:
            return position
    return None
