"""Split a step's events into EventBatch messages that fit gRPC's message size (DECISIONS 45).

A batch is cut between events (order kept), and one event too big for a message alone is cut
between its blocks: a ``BlockStored`` of blocks h1..hn with parent p becomes pieces whose first
block's parent is the last block of the piece before it (p for the first), with the token ids
(and extra keys) of exactly its blocks, so applying the pieces in order is applying the event.
A ``BlockRemoved`` is cut the same way (its hashes only). The pieces then go out under
consecutive seqs, which the daemon applies in order like any other batches.

A single block that alone does not fit (an absurd block size, a huge LoRA name) cannot be cut:
it is left out and reported as :class:`BatchTooLarge` (the log then under-reports that block, it
never claims one it was not told about), and the rest of the batch still goes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvcache.v1 import events_pb2

from offloadd.errors import OffloaddError

DAEMON_MAX_MESSAGE_BYTES = 64 << 20
"""The daemon's default largest gRPC message received (--max-message-bytes), and what
OffloadClient accepts in return, so a record or snapshot it accepted can be read back."""

DEFAULT_MAX_MESSAGE_BYTES = (4 << 20) - (64 << 10)
"""Largest EventBatch IngestStream sends: under gRPC's default 4 MiB receive limit, so the log
record it becomes (a few bytes more) reaches a Subscribe client with default options too."""

_ENVELOPE_SLACK = 64  # the daemon may prepend AllBlocksCleared; a LogRecord adds its offset
_MAX_U64 = (1 << 64) - 1


class BatchTooLarge(OffloaddError, ValueError):
    """Events that could not be sent at all: one block alone encodes past the message limit."""

    def __init__(self, message: str, left_out: int) -> None:
        super().__init__(message)
        self.left_out = left_out  # events (or blocks of an event) dropped


@dataclass
class Split:
    batches: list[list[events_pb2.KvEvent]]
    refused: list[BatchTooLarge]


def fit_batches(batches: list[events_pb2.EventBatch], max_message_bytes: int,
                max_events: int) -> tuple[list[events_pb2.EventBatch], list[BatchTooLarge]]:
    """``batches`` (of one engine, in order) as batches that fit: one that does is kept as it
    is, one that does not is replaced by its parts; seqs are left for the caller to number."""
    out: list[events_pb2.EventBatch] = []
    refused: list[BatchTooLarge] = []
    for batch in batches:
        budget = event_budget(batch.engine_id, max_message_bytes)
        if len(batch.events) <= max_events and batch.ByteSize() <= budget:
            out.append(batch)  # the usual case: nothing copied
            continue
        split = split_events(list(batch.events), budget, max_events)
        refused.extend(split.refused)
        out.extend(events_pb2.EventBatch(engine_id=batch.engine_id, events=part)
                   for part in split.batches)
    return out, refused


def event_budget(engine_id: str, max_message_bytes: int) -> int:
    """Bytes the events of one batch may take: the limit less the batch's other fields."""
    envelope = events_pb2.EventBatch(engine_id=engine_id, incarnation=_MAX_U64, seq=_MAX_U64, ts=1.5)
    return max_message_bytes - envelope.ByteSize() - _ENVELOPE_SLACK


def _cost(event: events_pb2.KvEvent) -> int:
    """Bytes ``event`` adds to a batch (its field tag, length prefix and body)."""
    size = event.ByteSize()
    return 1 + _varint_len(size) + size


def _varint_len(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def split_events(events: list[events_pb2.KvEvent], budget: int, max_events: int) -> Split:
    """``events`` packed in order into batches of at most ``budget`` bytes of events and
    ``max_events`` events each; events too big alone are cut by blocks (module doc)."""
    out: list[list[events_pb2.KvEvent]] = []
    refused: list[BatchTooLarge] = []
    current: list[events_pb2.KvEvent] = []
    used = 0
    for event in events:
        for piece in _pieces(event, budget, refused):
            cost = _cost(piece)
            if current and (used + cost > budget or len(current) >= max_events):
                out.append(current)
                current, used = [], 0
            current.append(piece)
            used += cost
    if current:
        out.append(current)
    return Split(out, refused)


def _pieces(event: events_pb2.KvEvent, budget: int,
            refused: list[BatchTooLarge]) -> Iterator[events_pb2.KvEvent]:
    """``event`` itself when it fits, else its block-wise pieces (halving until each fits)."""
    if _cost(event) <= budget:
        yield event
        return
    kind = event.WhichOneof("event")
    n = len(getattr(event, kind).block_hashes) if kind != "all_blocks_cleared" else 0
    if n <= 1:
        refused.append(BatchTooLarge(
            f"a {kind} event of {n} block(s) encodes to {_cost(event)} bytes, more than the "
            f"{budget} one batch may carry: left out (the log will not claim it)", 1))
        return
    half = n // 2
    yield from _pieces(_blocks(event, 0, half), budget, refused)
    yield from _pieces(_blocks(event, half, n), budget, refused)


def _blocks(event: events_pb2.KvEvent, start: int, stop: int) -> events_pb2.KvEvent:
    """The part of a BlockStored or BlockRemoved ``event`` about blocks [start, stop)."""
    if event.HasField("block_removed"):
        removed = event.block_removed
        return events_pb2.KvEvent(block_removed=events_pb2.BlockRemoved(
            block_hashes=removed.block_hashes[start:stop], medium=removed.medium,
            group_idx=removed.group_idx))
    src = event.block_stored
    size = src.block_size
    stored = events_pb2.BlockStored(
        block_hashes=src.block_hashes[start:stop], token_ids=src.token_ids[start * size : stop * size],
        block_size=size, medium=src.medium, group_idx=src.group_idx,
        kv_cache_spec_kind=src.kv_cache_spec_kind, extra_keys=src.extra_keys[start:stop],
    )
    for name in ("sliding_window", "lora_name", "provenance"):
        if src.HasField(name):
            setattr(stored, name, getattr(src, name))
    if start > 0:
        stored.parent_block_hash = src.block_hashes[start - 1]
    elif src.HasField("parent_block_hash"):
        stored.parent_block_hash = src.parent_block_hash
    return events_pb2.KvEvent(block_stored=stored)
