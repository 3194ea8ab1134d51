"""Protobuf messages (kvcache.v1) <-> domain events, batches, log records and snapshots.

Used at the gRPC edge: servicers convert with these functions and work on domain types only.
Decoding validates (what ``validate_event`` checks that the proto field types do not already
guarantee) and raises SchemaError naming the field. Imports only the generated message modules,
never grpc.
"""

from __future__ import annotations

from typing import Any, Final

import cbor2
import msgspec
from kvcache.v1 import events_pb2, log_pb2

from events.codec_vllm import freeze_arrays
from events.packed import PackedStored, pack, unpacked
from events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    LogRecord,
    Medium,
    SchemaError,
    SpecKind,
    check_extra_keys,
)
from events.state import Snapshot, SourceSnapshot


class EventBatch(msgspec.Struct, frozen=True):
    """One step's events from one engine, as sent on ``EventIngest.Publish``."""

    engine_id: str
    incarnation: int
    seq: int
    ts: float
    events: tuple[Event, ...]


_MEDIUM_TO_PB: Final[dict[Medium | None, int]] = {
    None: events_pb2.MEDIUM_UNSPECIFIED,
    "GPU": events_pb2.MEDIUM_GPU,
    "CPU": events_pb2.MEDIUM_CPU,
}
_MEDIUM_FROM_PB: Final[dict[int, Medium | None]] = {v: k for k, v in _MEDIUM_TO_PB.items()}
_KIND_TO_PB: Final[dict[SpecKind, int]] = {
    "full_attention": events_pb2.KV_CACHE_SPEC_KIND_FULL_ATTENTION,
    "sliding_window": events_pb2.KV_CACHE_SPEC_KIND_SLIDING_WINDOW,
}
_KIND_FROM_PB: Final[dict[int, SpecKind]] = {
    events_pb2.KV_CACHE_SPEC_KIND_UNSPECIFIED: "full_attention",
    **{v: k for k, v in _KIND_TO_PB.items()},
}


# -- events -------------------------------------------------------------------------------------


def event_to_proto(event: Event) -> events_pb2.KvEvent:
    """Raise SchemaError when a value does not fit the proto field (e.g. a negative group)."""
    msg = events_pb2.KvEvent()
    _fill_event(msg, event)
    return msg


def _fill_event(msg: events_pb2.KvEvent, event: Event) -> None:
    """Write ``event`` into an empty KvEvent in place (a nested message built apart and then
    assigned is copied: filling in place costs half as much per event)."""
    try:
        _fill(msg, event)
    except (ValueError, TypeError) as exc:
        raise SchemaError(f"{type(event).__name__}: {exc}") from exc


def _fill(msg: events_pb2.KvEvent, event: Event) -> None:
    if type(event) is PackedStored:
        event = unpacked(event)
    if isinstance(event, BlockStored):
        stored = msg.block_stored
        stored.block_hashes.extend(event.block_hashes)
        stored.token_ids.extend(event.token_ids)
        stored.block_size = event.block_size
        stored.medium = _MEDIUM_TO_PB[event.medium]
        stored.group_idx = event.group_idx
        stored.kv_cache_spec_kind = _KIND_TO_PB[event.kv_cache_spec_kind]
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        if event.sliding_window is not None:
            stored.sliding_window = event.sliding_window
        if event.lora_name is not None:
            stored.lora_name = event.lora_name
        if event.extra_keys is not None:
            stored.extra_keys.extend(cbor2.dumps(k, canonical=True) for k in event.extra_keys)
        if event.provenance is not None:
            stored.provenance = event.provenance
    elif isinstance(event, BlockRemoved):
        removed = msg.block_removed
        removed.block_hashes.extend(event.block_hashes)
        removed.medium = _MEDIUM_TO_PB[event.medium]
        removed.group_idx = event.group_idx
    else:
        msg.all_blocks_cleared.medium = _MEDIUM_TO_PB[event.medium]


def event_from_proto(msg: events_pb2.KvEvent, *, packed: bool = False) -> Event:
    """Decode and validate one event. The proto field types already guarantee what
    ``validate_event`` checks of ranges (fixed64 hashes, uint32 groups and sizes), so only the
    rest is checked here, with the same messages; every event this returns passes it.
    ``packed``: a ``BlockStored`` comes with its token ids packed (events.packed)."""
    which = msg.WhichOneof("event")
    if which == "block_stored":
        return _stored_from_proto(msg.block_stored, packed)
    if which == "block_removed":
        m = msg.block_removed
        return BlockRemoved(tuple(m.block_hashes[:]), _required_medium(m.medium, "BlockRemoved"),
                            m.group_idx)
    if which == "all_blocks_cleared":
        return AllBlocksCleared(_medium(msg.all_blocks_cleared.medium, "AllBlocksCleared"))
    raise SchemaError("KvEvent.event: required (one of block_stored, block_removed, ...)")


def _stored_from_proto(m: events_pb2.BlockStored, packed: bool = False) -> BlockStored:
    kind = _KIND_FROM_PB.get(m.kv_cache_spec_kind)
    if kind is None:
        raise SchemaError(f"BlockStored.kv_cache_spec_kind: unknown value {m.kv_cache_spec_kind}")
    extra: tuple[Any, ...] | None = None
    if m.extra_keys:
        try:
            extra = tuple(freeze_arrays(cbor2.loads(k)) for k in m.extra_keys)
        except (cbor2.CBORDecodeError, ValueError, TypeError) as exc:
            raise SchemaError(f"BlockStored.extra_keys: bad CBOR: {exc}") from exc
    medium = _MEDIUM_FROM_PB.get(m.medium)
    if medium is None:
        medium = _required_medium(m.medium, "BlockStored")  # raises, naming what is wrong
    hashes = tuple(m.block_hashes[:])  # a slice copies a repeated field faster than iterating
    if not hashes:
        raise SchemaError("BlockStored.block_hashes: must not be empty")
    size = m.block_size
    if size == 0:
        raise SchemaError("BlockStored.block_size: must be > 0, got 0")
    ids = m.token_ids[:]
    if len(ids) != len(hashes) * size:
        raise SchemaError(
            f"BlockStored.token_ids: expected {len(hashes) * size} ids "
            f"({len(hashes)} blocks x {size}), got {len(ids)}"
        )
    if extra is not None:
        if len(extra) != len(hashes):
            raise SchemaError("BlockStored.extra_keys: need one entry per block hash")
        for i, keys in enumerate(extra):
            check_extra_keys(keys, f"BlockStored.extra_keys[{i}]")
    return (PackedStored if packed else BlockStored)(
        hashes,
        m.parent_block_hash if m.HasField("parent_block_hash") else None,
        pack(ids) if packed else tuple(ids),  # type: ignore[arg-type]
        size,
        medium,
        m.group_idx,
        kind,
        m.sliding_window if m.HasField("sliding_window") else None,
        m.lora_name if m.HasField("lora_name") else None,
        extra,
        m.provenance if m.HasField("provenance") else None,
    )


def _medium(value: int, owner: str) -> Medium | None:
    if value not in _MEDIUM_FROM_PB:
        raise SchemaError(f"{owner}.medium: unknown value {value}")
    return _MEDIUM_FROM_PB[value]


def _required_medium(value: int, owner: str) -> Medium:
    medium = _medium(value, owner)
    if medium is None:
        raise SchemaError(f"{owner}.medium: required")
    return medium


def _events_from_proto(msgs: Any, packed: bool = False) -> tuple[Event, ...]:
    return tuple([event_from_proto(m, packed=packed) for m in msgs])


def _events_to_proto(out: Any, events: tuple[Event, ...]) -> None:
    """Append ``events`` to the repeated KvEvent field ``out``."""
    for event in events:
        _fill_event(out.add(), event)


# -- batches, records, snapshots ----------------------------------------------------------------


def batch_to_proto(batch: EventBatch) -> events_pb2.EventBatch:
    msg = events_pb2.EventBatch(
        engine_id=batch.engine_id,
        incarnation=batch.incarnation,
        seq=batch.seq,
        ts=batch.ts,
    )
    _events_to_proto(msg.events, batch.events)
    return msg


def batch_from_proto(msg: events_pb2.EventBatch, *, packed: bool = False) -> EventBatch:
    """The batch, validated; ``packed``: its ``BlockStored`` events with their token ids packed
    (events.packed: the daemon's ingest, which only logs and counts them)."""
    if not msg.engine_id:
        raise SchemaError("EventBatch.engine_id: required")
    return EventBatch(
        msg.engine_id, msg.incarnation, msg.seq, msg.ts, _events_from_proto(msg.events, packed)
    )


def record_to_proto(record: LogRecord) -> events_pb2.LogRecord:
    msg = events_pb2.LogRecord(
        offset=record.offset,
        source=record.source,
        incarnation=record.incarnation,
        source_seq=record.source_seq,
        ts=record.ts,
    )
    _events_to_proto(msg.events, record.events)
    return msg


def record_from_proto(msg: events_pb2.LogRecord) -> LogRecord:
    if msg.offset < 1:
        raise SchemaError("LogRecord.offset: must be >= 1")
    return LogRecord(
        offset=msg.offset,
        source=msg.source,
        incarnation=msg.incarnation,
        source_seq=msg.source_seq,
        ts=msg.ts,
        events=_events_from_proto(msg.events),
    )


def snapshot_to_proto(snap: Snapshot) -> log_pb2.SnapshotResponse:
    msg = log_pb2.SnapshotResponse(offset=snap.offset)
    for s in snap.sources:
        source = msg.sources.add(source=s.source, incarnation=s.incarnation, last_seq=s.last_seq)
        _events_to_proto(source.events, s.events)
    return msg


def snapshot_from_proto(msg: log_pb2.SnapshotResponse) -> Snapshot:
    sources = []
    for s in msg.sources:
        stored: list[BlockStored] = []
        for e in _events_from_proto(s.events):
            if not isinstance(e, BlockStored):
                raise SchemaError(
                    f"SourceSnapshot.events: only BlockStored allowed, got {type(e).__name__}"
                )
            stored.append(e)
        sources.append(SourceSnapshot(s.source, s.incarnation, s.last_seq, tuple(stored)))
    return Snapshot(msg.offset, tuple(sources))
