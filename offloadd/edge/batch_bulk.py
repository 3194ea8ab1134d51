"""The stored- and removed-block events of a Publish batch read in bulk: one upb parse per
batch, not a dozen field reads per event.

``events.codec_proto.batch_from_proto`` reads a parsed ``EventBatch`` event by event, and each
field read of a upb message from Python costs 0.1-0.5 us (a repeated field builds a container
each time): ~3 us per single-block ``BlockStored``, the daemon's largest cost per event in
vLLM's batch shape (DECISIONS 70). Here the batch's bytes are parsed a second time as
:data:`_Flat`, a message of the same field numbers in which ``events``, ``block_stored`` and
``block_removed`` are singular: protobuf merges repeated occurrences of a singular message, so
every repeated field below collects the values of all events in order, in C. Each event's
hashes and token ids are its packed runs (``bytes``), joined and unpacked once for the batch;
each event's bytes (read once more, as a list) must be one stored or removed message that
spans them, and its first byte says which kind it is, in order.

The columns line up with the events only when every event is one ``BlockStored`` or
``BlockRemoved`` that carries each column exactly once (or, for the fields that default, none
of its kind does; a parent, set on some events only, is found right after each event's
hashes): anything else (a clear, extra keys, a LoRA name, a window, a group set on some events
only, an empty removal, an unpacked run) returns None and the caller reads the message as
before, so results and errors are that decoder's. Every event returned passes the checks it
makes. One difference is possible, for input no protobuf encoder writes: an event that repeats
a singular field (or splits a packed run) next to an event missing it can line up here where
the decoder would merge the repeats and refuse the other.
"""

from __future__ import annotations

import struct
from typing import Any, Final

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from kvcache.v1 import events_pb2

from events.codec_proto import EventBatch, batch_from_proto
from events.packed import PackedStored, pack
from events.schema import BlockRemoved, Event, Medium, SpecKind

_F = descriptor_pb2.FieldDescriptorProto
_COLUMNS: Final = (  # BlockStored's fields as columns: (name, number, type)
    ("block_hashes", 1, _F.TYPE_BYTES),  # one packed fixed64 run per event
    ("parent_block_hash", 2, _F.TYPE_FIXED64),
    ("token_ids", 3, _F.TYPE_BYTES),  # one packed varint run per event
    ("block_size", 4, _F.TYPE_UINT32),
    ("medium", 5, _F.TYPE_UINT32),
    ("group_idx", 6, _F.TYPE_UINT32),
    ("kv_cache_spec_kind", 7, _F.TYPE_UINT32),
    ("sliding_window", 8, _F.TYPE_UINT32),
    ("lora_name", 9, _F.TYPE_BYTES),
    ("extra_keys", 10, _F.TYPE_BYTES),
    ("provenance", 11, _F.TYPE_BYTES),
)


def _classes() -> tuple[Any, Any]:
    """``Batch {Event events = 5}``, ``Event {Stored block_stored = 1; Removed block_removed =
    2; repeated bytes all_blocks_cleared = 3}``, ``Stored {repeated <column>}``, ``Removed
    {repeated bytes block_hashes = 1; repeated uint32 medium = 2, group_idx = 3}``; and
    ``Events {repeated bytes events = 5}`` (each event's bytes)."""
    fdp = descriptor_pb2.FileDescriptorProto(
        name="offloadd_edge_batch_bulk.proto", package="offloadd.edge.bulk", syntax="proto3")
    stored = fdp.message_type.add(name="Stored")
    for name, number, kind in _COLUMNS:
        stored.field.add(name=name, number=number, type=kind, label=_F.LABEL_REPEATED)
    removed = fdp.message_type.add(name="Removed")
    for name, number, kind in (("block_hashes", 1, _F.TYPE_BYTES), ("medium", 2, _F.TYPE_UINT32),
                               ("group_idx", 3, _F.TYPE_UINT32)):
        removed.field.add(name=name, number=number, type=kind, label=_F.LABEL_REPEATED)
    event = fdp.message_type.add(name="Event")
    for name, number, what in (("block_stored", 1, "Stored"), ("block_removed", 2, "Removed")):
        event.field.add(name=name, number=number, type=_F.TYPE_MESSAGE,
                        label=_F.LABEL_OPTIONAL, type_name=f".offloadd.edge.bulk.{what}")
    event.field.add(name="all_blocks_cleared", number=3, type=_F.TYPE_BYTES,
                    label=_F.LABEL_REPEATED)
    batch = fdp.message_type.add(name="Batch")
    batch.field.add(name="events", number=5, type=_F.TYPE_MESSAGE, label=_F.LABEL_OPTIONAL,
                    type_name=".offloadd.edge.bulk.Event")
    fdp.message_type.add(name="Events").field.add(
        name="events", number=5, type=_F.TYPE_BYTES, label=_F.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return (message_factory.GetMessageClass(pool.FindMessageTypeByName("offloadd.edge.bulk.Batch")),
            message_factory.GetMessageClass(pool.FindMessageTypeByName("offloadd.edge.bulk.Events")))


_Flat, _Events = _classes()
_TokenRun: Final = events_pb2.BlockStored  # its field 3 (packed uint32) reads a joined run
_TOKENS_TAG: Final = bytes((3 << 3 | 2,))
_MEDIUM: Final[dict[int, Medium]] = {events_pb2.MEDIUM_GPU: "GPU", events_pb2.MEDIUM_CPU: "CPU"}
_KIND: Final[dict[int, SpecKind]] = {
    events_pb2.KV_CACHE_SPEC_KIND_UNSPECIFIED: "full_attention",
    events_pb2.KV_CACHE_SPEC_KIND_FULL_ATTENTION: "full_attention",
    events_pb2.KV_CACHE_SPEC_KIND_SLIDING_WINDOW: "sliding_window",
}
_HIGH: Final = bytes(range(0x80, 0x100))  # varint continuation bytes: the rest end one id each
BULK_MIN_EVENTS: Final = 8
"""Fewer events are read one by one: the bulk parse costs more than it saves (one event of 256
blocks reads ~25% slower in bulk; 100 single-block events ~2x faster)."""


def batch_from_wire(raw: bytes, msg: events_pb2.EventBatch) -> EventBatch:
    """``batch_from_proto(msg, packed=True)``, ``msg`` parsed from ``raw``: the same batch or
    SchemaError. Token ids come packed (events.packed): the daemon logs them and counts them,
    and never holds them as ints (DECISIONS 80)."""
    num_events = len(msg.events)
    events = None
    if num_events >= BULK_MIN_EVENTS:
        try:
            events = stored_events(raw, num_events)
        except (IndexError, ValueError, struct.error):  # columns that do not line up
            events = None
    if events is None or not msg.engine_id:
        return batch_from_proto(msg, packed=True)
    return EventBatch(msg.engine_id, msg.incarnation, msg.seq, msg.ts, events)


def stored_events(raw: bytes, num_events: int) -> tuple[Event, ...] | None:
    """The ``num_events`` events of the ``EventBatch`` encoded in ``raw`` (already parsed by
    the caller: valid protobuf) when all are stored or removed blocks in the usual layout;
    else None."""
    if num_events == 0:
        return None
    event = _Flat.FromString(raw).events
    if event.all_blocks_cleared:
        return None
    removed_runs: list[bytes] = event.block_removed.block_hashes[:]
    each: list[bytes] = _Events.FromString(raw).events[:]
    if len(each) != num_events or not all(map(_one_field, each)):
        return None  # an empty event, or one of two (merged here, refused by the decoder)
    is_stored = [e[0] == 0x0A for e in each]  # else field 2, a removal
    num_stored = sum(is_stored)
    if num_stored + len(removed_runs) != num_events:
        return None
    stored_each = [e for e, s in zip(each, is_stored, strict=True) if s] if removed_runs else each
    stored = _stored(event.block_stored, num_stored, stored_each) if num_stored else []
    removed = _removed(event.block_removed, removed_runs) if removed_runs else []
    if stored is None or removed is None:
        return None
    if not removed_runs:
        return tuple(stored)
    next_stored, next_removed = iter(stored), iter(removed)
    return tuple(next(next_stored) if s else next(next_removed) for s in is_stored)


def _removed(r: Any, runs: list[bytes]) -> list[Event] | None:
    """The removals' columns as events (None: not one of each per event, or refused)."""
    n = len(runs)
    media: list[int] = r.medium[:]
    groups = _column(r.group_idx[:], n, 0)
    hashes = _hashes(runs)
    if len(media) != n or groups is None or hashes is None or not _MEDIUM.keys() >= set(media):
        return None
    out: list[Event] = []
    at = 0
    for run, m, group in zip(runs, media, groups, strict=True):
        num = len(run) >> 3
        out.append(BlockRemoved(hashes[at:at + num], _MEDIUM[m], group))
        at += num
    return out


def _stored(s: Any, num_events: int, each: list[bytes]) -> list[Event] | None:
    """The stored blocks' columns as events (None: they do not line up, or one is refused);
    ``each``: the stored events' bytes."""
    runs: list[bytes] = s.block_hashes[:]
    token_runs: list[bytes] = s.token_ids[:]
    sizes: list[int] = s.block_size[:]
    media: list[int] = s.medium[:]
    if not (len(runs) == len(token_runs) == len(sizes) == len(media) == num_events):
        return None
    if s.sliding_window or s.lora_name or s.extra_keys or s.provenance:
        return None
    groups = _column(s.group_idx[:], num_events, 0)
    kinds = _column(s.kv_cache_spec_kind[:], num_events, 0)
    parents = _parents(s.parent_block_hash[:], runs, each)
    if groups is None or kinds is None or parents is None:
        return None
    if 0 in sizes or not _MEDIUM.keys() >= set(media) or not _KIND.keys() >= set(kinds):
        return None  # the decoder says what is wrong
    hashes = _hashes(runs)
    if hashes is None:
        return None
    joined = b"".join(token_runs)
    tokens = _TokenRun.FromString(_TOKENS_TAG + _varint(len(joined)) + joined).token_ids[:]
    out: list[Event] = []
    at_hash = at_token = 0
    medium, kind = _MEDIUM, _KIND
    for run, token_run, size, m, group, k, parent in zip(
            runs, token_runs, sizes, media, groups, kinds, parents, strict=True):
        num_hashes = len(run) >> 3
        num_tokens = len(token_run.translate(None, _HIGH))  # one byte below 0x80 ends each id
        if num_tokens != num_hashes * size:
            return None  # the decoder says what is wrong
        ids = pack(tokens[at_token:at_token + num_tokens])
        out.append(PackedStored(hashes[at_hash:at_hash + num_hashes], parent,
                                ids, size, medium[m], group, kind[k]))  # type: ignore[arg-type]
        at_hash += num_hashes
        at_token += num_tokens
    return out


def _one_field(event: bytes) -> bool:
    """A KvEvent's bytes are one ``block_stored`` (field 1) or ``block_removed`` (field 2)
    message that spans them: the columns can be read as one event's."""
    if len(event) < 2 or event[0] not in (0x0A, 0x12):
        return False
    if event[1] < 0x80:  # a message under 128 bytes (vLLM's single-block event): one byte
        return event[1] + 2 == len(event)
    size, at = _read_varint(event, 1)
    return at + size == len(event)


def _column(values: list[Any], n: int, default: Any) -> list[Any] | None:
    """A field that may be left out: all events have it, or none does (``default``)."""
    if not values:
        return [default] * n
    return values if len(values) == n else None


def _parents(values: list[int], runs: list[bytes], each: list[bytes]) -> list[int | None] | None:
    """Each event's parent: all or none have one, or, in the usual field order (the parent
    right after the hashes), those whose hashes are followed by one."""
    n = len(runs)
    if not values or len(values) == n:
        return _column(values, n, None)
    has: list[bool] = []
    if len(each) != n:
        return None
    for event, run in zip(each, runs, strict=True):
        # KvEvent: 0x0a <len> BlockStored: 0x0a <len> hashes [0x11 parent] ...
        if event[0] != 0x0A:
            return None
        _, at = _read_varint(event, 1)
        if event[at] != 0x0A:
            return None
        size, at = _read_varint(event, at + 1)
        if size != len(run):
            return None
        at += size
        has.append(at < len(event) and event[at] == 0x11)
    if sum(has) != len(values):
        return None
    found = iter(values)
    return [next(found) if h else None for h in has]


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = data[at]
        value |= (b & 0x7F) << shift
        at += 1
        if b < 0x80:
            return value, at
        shift += 7


def _hashes(runs: list[bytes]) -> tuple[int, ...] | None:
    """Every event's hashes, in order (None when a run is empty or not whole fixed64s)."""
    for run in runs:
        if not run or len(run) & 7:
            return None
    joined = b"".join(runs)
    return struct.unpack(f"<{len(joined) >> 3}Q", joined)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
