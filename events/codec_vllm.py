"""Batches of events as msgpack in vLLM's KV-event layout (shared/docs/WIRE.md).

A batch is the array ``[ts, events, data_parallel_rank]``. Events are maps with a ``"type"`` key
(vLLM v0.26, the default) or positional arrays (the legacy layout of v0.23 and older). Our
extensions ride where vLLM consumers ignore them: a ``source`` key per event (docs/DECISIONS.md
item 4) and the ``medium`` of an ``AllBlocksCleared``; in the legacy layout they are extra
trailing array elements (msgspec's array-like decoding ignores extra trailing elements).

This module is the one definition of the wire layouts and of the mapping between domain events
and them. :func:`encode_batch` also takes a stored record's events as read by
``events.records.decode_record_view``: their bulk arrays are copied onto the wire as the
msgpack bytes they were stored as, without being decoded (the bridge's publish path).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Final, Generic, Literal, TypeVar

import msgspec

from events.packed import PackedStored
from events.records import ClearedView, RemovedView, StoredView
from events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    SchemaError,
    validate_event,
)

Layout = Literal["map", "legacy"]


class WireBatch(msgspec.Struct, frozen=True):
    """A decoded batch; ``sources`` has one entry per event (None where the event had none)."""

    ts: float
    events: tuple[Event, ...]
    dp_rank: int
    sources: tuple[str | None, ...]


# -- map layout (vLLM v0.26): required fields have no default, so they are always encoded ------

H = TypeVar("H")
"""``block_hashes`` and ``token_ids``: int tuples, or msgspec.Raw copied from a stored record."""

_Ints = tuple[int, ...]


class _MapStored(
    msgspec.Struct, Generic[H], tag="BlockStored", tag_field="type", omit_defaults=True
):
    block_hashes: H
    parent_block_hash: int | None
    token_ids: H
    block_size: int
    lora_id: int | None
    medium: str
    lora_name: str | None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None  # nil or absent: group 0
    kv_cache_spec_kind: str | None = None  # nil or absent: full attention
    kv_cache_spec_sliding_window: int | None = None
    source: str | None = None


class _MapRemoved(
    msgspec.Struct, Generic[H], tag="BlockRemoved", tag_field="type", omit_defaults=True
):
    block_hashes: H
    medium: str
    group_idx: int | None = None
    source: str | None = None


class _MapCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", omit_defaults=True):
    medium: str | None = None
    source: str | None = None


_MapEvent = _MapStored[_Ints] | _MapRemoved[_Ints] | _MapCleared


class _MapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


# -- legacy layout: positional arrays (decoding; encoding builds lists, see _to_legacy) ----------


class _LegacyStored(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str
    # Old vLLM versions end here; we always encode the rest but accept its absence.
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None  # nil or absent: group 0
    kv_cache_spec_kind: str | None = None  # nil or absent: full attention
    kv_cache_spec_sliding_window: int | None = None
    source: str | None = None


class _LegacyRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: tuple[int, ...]
    medium: str
    group_idx: int | None = None
    source: str | None = None


class _LegacyCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    medium: str | None = None
    source: str | None = None


_LegacyEvent = _LegacyStored | _LegacyRemoved | _LegacyCleared
_WireEvent = _MapEvent | _LegacyEvent


class _EncodeBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int


class _RawBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_REQUIRED: Final[dict[str, tuple[str, ...]]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
_LEGACY_REQUIRED: Final[dict[str, int]] = {"BlockStored": 6, "BlockRemoved": 2}
_LEGACY_FIELDS: Final[dict[str, tuple[str, ...]]] = {
    name: tuple(f for f in cls.__struct_fields__)
    for name, cls in (
        ("BlockStored", _LegacyStored),
        ("BlockRemoved", _LegacyRemoved),
        ("AllBlocksCleared", _LegacyCleared),
    )
}

_ENCODER: Final = msgspec.msgpack.Encoder()
_MAP_BATCH: Final = msgspec.msgpack.Decoder(_MapBatch)
_RAW_BATCH: Final = msgspec.msgpack.Decoder(_RawBatch)
_MAP_EVENT: Final = msgspec.msgpack.Decoder(_MapEvent)  # type: ignore[arg-type]
_LEGACY_EVENT: Final = msgspec.msgpack.Decoder(_LegacyEvent)  # type: ignore[arg-type]
_ANY: Final = msgspec.msgpack.Decoder()


def encode_batch(
    events: Sequence[Event],
    ts: float,
    *,
    layout: Literal["map", "legacy"] = "map",
    dp_rank: int = 0,
    source: str | None = None,
) -> bytes:
    """One vLLM batch; ``source`` (our extension) is attached to every event when given.

    ``events`` are domain events (a ``BlockStored`` may be packed: events.packed), or the
    events of an ``events.records.RecordView``: the same batch, byte for byte, as for the
    record's domain events.
    """
    if layout == "map":
        wire: list[Any] = [_TO_MAP[type(e)](e, source) for e in events]
    elif layout == "legacy":
        wire = [_to_legacy(e, source) for e in events]
    else:
        raise ValueError(f"unknown layout {layout!r}; choose 'map' or 'legacy'")
    return _ENCODER.encode(_EncodeBatch(float(ts), wire, dp_rank))


def _stored_to_map(e: BlockStored, source: str | None) -> _MapStored[Any]:
    sliding = e.kv_cache_spec_kind == "sliding_window"
    # Defaults travel as None so that omit_defaults leaves them out, as vLLM does.
    return _MapStored(
        e.block_hashes,
        e.parent_block_hash,
        e.token_ids,
        e.block_size,
        None,
        e.medium,
        e.lora_name,
        e.extra_keys,
        e.group_idx or None,
        e.kv_cache_spec_kind if sliding else None,
        e.sliding_window if sliding else None,
        source,
    )


def _removed_to_map(e: BlockRemoved, source: str | None) -> _MapRemoved[Any]:
    return _MapRemoved(e.block_hashes, e.medium, e.group_idx or None, source)


def _cleared_to_map(e: AllBlocksCleared, source: str | None) -> _MapCleared:
    return _MapCleared(e.medium, source)


# Dispatch on the exact type (a failed isinstance on a Struct class costs more than the
# mapping); a record view (events.records) maps like the domain event it was derived from.
_TO_MAP: Final[dict[type, Callable[[Any, str | None], Any]]] = {
    BlockStored: _stored_to_map,
    BlockRemoved: _removed_to_map,
    AllBlocksCleared: _cleared_to_map,
    StoredView: _stored_to_map,
    PackedStored: _stored_to_map,
    RemovedView: _removed_to_map,
    ClearedView: _cleared_to_map,
}
_STORED: Final = (BlockStored, StoredView, PackedStored)
_REMOVED: Final = (BlockRemoved, RemovedView)


def _to_legacy(e: Event, source: str | None) -> list[Any]:
    # vLLM's array-like structs encode every field (msgspec ignores omit_defaults there); our
    # extensions are appended only when set, so plain events match vLLM's bytes exactly.
    out: list[Any]
    if isinstance(e, _STORED):
        sliding = e.kv_cache_spec_kind == "sliding_window"
        out = [
            "BlockStored",
            e.block_hashes,
            e.parent_block_hash,
            e.token_ids,
            e.block_size,
            None,
            e.medium,
            e.lora_name,
            e.extra_keys,
            e.group_idx,
            e.kv_cache_spec_kind,
            e.sliding_window if sliding else None,
        ]
    elif isinstance(e, _REMOVED):
        out = ["BlockRemoved", e.block_hashes, e.medium, e.group_idx]
    else:
        out = ["AllBlocksCleared"]
        if e.medium is not None or source is not None:
            out.append(e.medium)
    if source is not None:
        out.append(source)
    return out


def decode_batch(payload: bytes) -> WireBatch:
    """Decode and validate one batch of either layout; raise SchemaError naming what is wrong."""
    try:
        return _decode(payload)
    except SchemaError:
        raise
    except Exception as exc:  # garbage of any shape must surface as SchemaError only
        raise SchemaError(f"vLLM batch: {exc}") from exc


def _decode(payload: bytes) -> WireBatch:
    try:
        fast = _MAP_BATCH.decode(payload)  # the common case: every event in the map layout
        wire: list[_WireEvent] = list(fast.events)
        ts, dp_rank = fast.ts, fast.data_parallel_rank
    except msgspec.DecodeError:
        try:
            raw = _RAW_BATCH.decode(payload)
        except msgspec.DecodeError as exc:
            raise SchemaError(f"vLLM batch: {exc}") from exc
        wire = [_decode_event(r, i) for i, r in enumerate(raw.events)]
        ts, dp_rank = raw.ts, raw.data_parallel_rank
    events = tuple(_to_domain(w) for w in wire)
    for event in events:
        validate_event(event)
    return WireBatch(ts, events, dp_rank or 0, tuple(w.source for w in wire))


def _decode_event(raw: msgspec.Raw, index: int) -> _WireEvent:
    data = bytes(raw)
    first = data[0]
    # msgpack arrays start with 0x90-0x9f (fixarray), 0xdc or 0xdd; anything else is a map here.
    is_array = 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)
    try:
        if is_array:
            event: _WireEvent = _LEGACY_EVENT.decode(data)
        else:
            event = _MAP_EVENT.decode(data)
        return event
    except msgspec.DecodeError as exc:
        raise SchemaError(_diagnose(_ANY.decode(data), index, exc)) from exc


def _diagnose(value: Any, index: int, exc: Exception) -> str:
    """A message naming the event type and the missing or malformed key."""
    where = f"event {index}"
    if isinstance(value, dict):
        etype = value.get("type")
        if not isinstance(etype, str) or etype not in _REQUIRED:
            return f"{where}: unknown or missing event type {etype!r}"
        for key in _REQUIRED[etype]:
            if key not in value:
                return f"{etype}: missing required key {key!r}"
    elif isinstance(value, list):
        etype = value[0] if value else None
        if not isinstance(etype, str) or etype not in _REQUIRED:
            return f"{where}: unknown or missing event type {etype!r}"
        needed = _LEGACY_REQUIRED.get(etype, 0)
        if len(value) - 1 < needed:
            missing = _REQUIRED[etype][len(value) - 1]
            return f"{etype}: missing required key {missing!r}"
    else:
        return f"{where}: expected a map or an array, got {type(value).__name__}"
    # msgspec says e.g. "Expected `int`, got `str` - at `$.block_size`" (or `$[4]` for arrays).
    match = re.fullmatch(r"(.*) - at `\$(?:\.(\w+)|\[(\d+)\])[^`]*`", str(exc))
    if match is None:
        return f"{etype}: {exc}"
    key = match[2]
    if match[3] is not None:
        fields = _LEGACY_FIELDS[etype]
        pos = int(match[3]) - 1
        key = fields[pos] if 0 <= pos < len(fields) else f"[{match[3]}]"
    return f"{etype}.{key}: {match[1]}"


def _to_domain(w: _WireEvent) -> Event:
    if isinstance(w, _MapStored | _LegacyStored):
        return BlockStored(
            block_hashes=w.block_hashes,
            parent_block_hash=w.parent_block_hash,
            token_ids=w.token_ids,
            block_size=w.block_size,
            medium=w.medium,  # type: ignore[arg-type]  # checked by validate_event
            group_idx=w.group_idx or 0,
            kv_cache_spec_kind=_spec_kind(w.kv_cache_spec_kind),
            sliding_window=w.kv_cache_spec_sliding_window,
            lora_name=w.lora_name,
            extra_keys=None if w.extra_keys is None else freeze_arrays(w.extra_keys),
        )
    if isinstance(w, _MapRemoved | _LegacyRemoved):
        return BlockRemoved(w.block_hashes, w.medium, w.group_idx or 0)  # type: ignore[arg-type]
    return AllBlocksCleared(w.medium)  # type: ignore[arg-type]


def _spec_kind(kind: str | None) -> Any:
    if kind is None:
        return "full_attention"
    if kind not in ("full_attention", "sliding_window"):
        raise SchemaError(f"BlockStored.kv_cache_spec_kind: unknown kind {kind!r}")
    return kind


def freeze_arrays(value: Any) -> Any:
    """Decoders give arrays as lists; events are frozen and hashable, so arrays become tuples.

    Shared by every codec for ``extra_keys``.
    """
    if isinstance(value, list | tuple):
        return tuple(freeze_arrays(v) for v in value)
    return value
