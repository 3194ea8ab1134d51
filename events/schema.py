"""Domain event types: past-tense facts about KV blocks, shared by every part of kvoffload.

Hashes in events are the 64-bit wire form (``BlockHash``): what vLLM publishes and routers
match on. The full digest a block's identity chains on (``BlockDigest``) lives in the engine's
block pool and the offload store RPCs; ``events.hashing.to_wire`` turns one into the other.
"""

from __future__ import annotations

from typing import Any, Final, Literal, NewType

import msgspec

from events.errors import EventsError

BlockHash = NewType("BlockHash", int)
"""The last 8 bytes of a block digest as an unsigned big-endian int, in [0, 2**64)."""

BlockDigest = NewType("BlockDigest", bytes)
"""A block's full chained digest (32 bytes for sha256_cbor, 16 for xxh3_128_cbor)."""

Medium = Literal["GPU", "CPU"]
MEDIA: Final[tuple[Medium, ...]] = ("GPU", "CPU")

SpecKind = Literal["full_attention", "sliding_window"]
SPEC_KINDS: Final[tuple[SpecKind, ...]] = ("full_attention", "sliding_window")

MAX_HASH: Final[int] = 2**64 - 1


class BlockStored(msgspec.Struct, frozen=True, tag=True):
    """Blocks became resident in ``medium``; ``token_ids`` covers every block, in order."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: Medium
    group_idx: int = 0
    kv_cache_spec_kind: SpecKind = "full_attention"
    sliding_window: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None  # one entry per block (None or a tuple)


class BlockRemoved(msgspec.Struct, frozen=True, tag=True):
    """Blocks left ``medium`` (evicted or freed)."""

    block_hashes: tuple[int, ...]
    medium: Medium
    group_idx: int = 0


class AllBlocksCleared(msgspec.Struct, frozen=True, tag=True):
    """Every block of the source in ``medium`` (every tier of the source when None) is gone."""

    medium: Medium | None = None


Event = BlockStored | BlockRemoved | AllBlocksCleared


class LogRecord(msgspec.Struct, frozen=True):
    """One entry of the durable log: a batch of events from one source.

    ``offset`` is global and contiguous from 1. ``(source, incarnation, source_seq)`` fences the
    source: seq starts at 1 in every incarnation and grows by one per batch.
    """

    offset: int
    source: str
    incarnation: int
    source_seq: int
    ts: float
    events: tuple[Event, ...]


class SchemaError(EventsError, ValueError):
    """An event or record violates the schema; the message names the field."""


def validate_event(event: Event) -> None:
    """Check the invariants a decoder cannot express in types; raise SchemaError."""
    if isinstance(event, BlockStored):
        _check_hashes(event.block_hashes, "block_hashes")
        if not event.block_hashes:
            raise SchemaError("BlockStored.block_hashes: must not be empty")
        if event.parent_block_hash is not None:
            _check_hashes((event.parent_block_hash,), "parent_block_hash")
        if event.block_size <= 0:
            raise SchemaError(f"BlockStored.block_size: must be > 0, got {event.block_size}")
        want = len(event.block_hashes) * event.block_size
        if len(event.token_ids) != want:
            raise SchemaError(
                f"BlockStored.token_ids: expected {want} ids "
                f"({len(event.block_hashes)} blocks x {event.block_size}), got {len(event.token_ids)}"
            )
        if event.medium not in MEDIA:
            raise SchemaError(f"BlockStored.medium: must be 'GPU' or 'CPU', got {event.medium!r}")
        if event.group_idx < 0:
            raise SchemaError(f"BlockStored.group_idx: must be >= 0, got {event.group_idx}")
        if event.extra_keys is not None and len(event.extra_keys) != len(event.block_hashes):
            raise SchemaError("BlockStored.extra_keys: need one entry per block hash")
    elif isinstance(event, BlockRemoved):
        _check_hashes(event.block_hashes, "block_hashes")
        if event.medium not in MEDIA:
            raise SchemaError(f"BlockRemoved.medium: must be 'GPU' or 'CPU', got {event.medium!r}")
        if event.group_idx < 0:
            raise SchemaError(f"BlockRemoved.group_idx: must be >= 0, got {event.group_idx}")
    elif event.medium is not None and event.medium not in MEDIA:
        raise SchemaError(f"AllBlocksCleared.medium: must be 'GPU', 'CPU' or None, got {event.medium!r}")


def _check_hashes(values: tuple[int, ...], field: str) -> None:
    for v in values:
        if not 0 <= v <= MAX_HASH:
            raise SchemaError(f"{field}: {v} is not an unsigned 64-bit hash")
