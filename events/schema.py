"""Domain event types: past-tense facts about KV blocks, shared by every part of kvoffload.

Hashes in events are the 64-bit wire form (``BlockHash``): what vLLM publishes and routers
match on. The full digest a block's identity chains on (``BlockDigest``) lives in the engine's
block pool and the offload store RPCs; ``events.hashing.to_wire`` turns one into the other.
"""

from __future__ import annotations

from typing import Any, Final, Literal, NewType

import cbor2
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


class BlockStored(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """Blocks became resident in ``medium``; ``token_ids`` covers every block, in order.
    Encoded without the fields that hold their defaults (a decoder fills them in): a log
    record of single-block events is half the bytes (DECISIONS 70)."""

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
    # Where CPU-tier blocks came from when not computed on this node ("fleet:<peer node>" for
    # a cross-node fetch); None: stored here. Ours only: the vLLM wire leaves it out.
    provenance: str | None = None


class BlockRemoved(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
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
        if event.extra_keys is not None:
            if len(event.extra_keys) != len(event.block_hashes):
                raise SchemaError("BlockStored.extra_keys: need one entry per block hash")
            for i, keys in enumerate(event.extra_keys):
                check_extra_keys(keys, f"BlockStored.extra_keys[{i}]")
    elif isinstance(event, BlockRemoved):
        _check_hashes(event.block_hashes, "block_hashes")
        if event.medium not in MEDIA:
            raise SchemaError(f"BlockRemoved.medium: must be 'GPU' or 'CPU', got {event.medium!r}")
        if event.group_idx < 0:
            raise SchemaError(f"BlockRemoved.group_idx: must be >= 0, got {event.group_idx}")
    elif not isinstance(event, AllBlocksCleared):
        raise SchemaError(f"not an event: {type(event).__name__}")
    elif event.medium is not None and event.medium not in MEDIA:
        raise SchemaError(f"AllBlocksCleared.medium: must be 'GPU', 'CPU' or None, got {event.medium!r}")


MAX_EXTRA_KEYS_DEPTH: Final[int] = 8
"""Arrays nested deeper than this in one block's extra keys are refused."""
MAX_EXTRA_KEYS_ITEMS: Final[int] = 1024
"""Values (scalars and arrays) in one block's extra keys, at most."""
MAX_EXTRA_KEYS_BYTES: Final[int] = 64 * 1024
"""Characters of strings plus bytes of byte strings in one block's extra keys, at most."""

_MIN_LOGGED_INT: Final[int] = -(2**63)  # what a msgpack integer holds


def check_extra_keys(keys: Any, where: str) -> None:
    """Refuse one block's extra keys unless the log can hold them exactly and an event can carry
    them (hashable): None, or an array of None, bool, int in [-2**63, 2**64), float, str, bytes
    and arrays of these, nested at most MAX_EXTRA_KEYS_DEPTH deep. Raise SchemaError naming the
    path of the first value that does not fit (a CBOR tag, undefined, a map, a big int...)."""
    if keys is None:
        return
    if type(keys) not in (tuple, list):
        raise SchemaError(f"{where}: must be an array or null, got {_kind(keys)}")
    budget = [MAX_EXTRA_KEYS_ITEMS, MAX_EXTRA_KEYS_BYTES]
    _check_key_value(keys, where, 1, budget)


def _check_key_value(value: Any, where: str, depth: int, budget: list[int]) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        raise SchemaError(f"{where}: more than {MAX_EXTRA_KEYS_ITEMS} values in one block's keys")
    kind = type(value)  # exact types: a subclass (a namedtuple, an IntEnum) is not what it logs as
    if value is None or kind is bool or kind is float:
        return
    if kind is int:
        if not _MIN_LOGGED_INT <= value <= MAX_HASH:
            raise SchemaError(f"{where}: integer {value} is outside [-2**63, 2**64) and cannot be logged")
        return
    if kind is str or kind is bytes:
        budget[1] -= len(value)
        if budget[1] < 0:
            raise SchemaError(f"{where}: more than {MAX_EXTRA_KEYS_BYTES} characters and bytes "
                              "in one block's keys")
        return
    if kind is tuple or kind is list:
        if depth > MAX_EXTRA_KEYS_DEPTH:
            raise SchemaError(f"{where}: arrays nested deeper than {MAX_EXTRA_KEYS_DEPTH}")
        for i, v in enumerate(value):
            _check_key_value(v, f"{where}[{i}]", depth + 1, budget)
        return
    raise SchemaError(f"{where}: {_kind(value)} cannot be logged")


def _kind(value: Any) -> str:
    """How a refused value reads in an error: CBOR's words for what cbor2 decodes it to."""
    if isinstance(value, cbor2.CBORTag):
        return f"CBOR tag {value.tag}"
    if value is cbor2.undefined:
        return "CBOR undefined"
    if isinstance(value, cbor2.CBORSimpleValue):
        return f"CBOR simple value {value.value}"
    if isinstance(value, dict):
        return "a map"
    return f"a value of type {type(value).__name__}"


def _check_hashes(values: tuple[int, ...], field: str) -> None:
    for v in values:
        if not 0 <= v <= MAX_HASH:
            raise SchemaError(f"{field}: {v} is not an unsigned 64-bit hash")
