"""The Redis projection: current state written beside each log record, in the same MULTI/EXEC.

Values are msgspec msgpack structs (array-like, compact). The projection exists so a restart
knows slots, checksums and layouts without re-deriving them; the log stays the truth and the
daemon checks one against the other on start (offloadd.log.recovery).
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from offloadd.tier.index import RestoredEntry


class ProjectedBlock(msgspec.Struct, array_like=True, frozen=True):
    """A committed CPU-tier block: where it is and how to re-announce it. Recovery decodes a
    row straight into a tier entry (decode_entry): its fields are SlotEntry's first seven, in
    this order."""

    slot: int
    group_idx: int
    checksum: int
    parent: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: bytes
    lora_name: str | None


class LayoutRecord(msgspec.Struct, array_like=True, frozen=True):
    """A registered KV layout: identity fields, its id, and how many chunk files it has."""

    layout_id: int
    model_namespace: str
    group_idx: int
    kind: str
    sliding_window: int
    block_size: int
    block_bytes: int
    dtype: str
    layout: str
    num_chunks: int
    slots_per_chunk: int = 0  # fixed when the first chunk file is made; 0 = not yet

    @property
    def identity(self) -> str:
        return layout_identity(
            self.model_namespace, self.group_idx, self.kind, self.sliding_window,
            self.block_size, self.block_bytes, self.dtype, self.layout,
        )


class EngineRecord(msgspec.Struct, array_like=True, frozen=True):
    engine_id: str
    incarnation: int
    model_namespace: str
    groups: tuple[tuple[int, int], ...]  # (group_idx, layout_id)


def layout_identity(
    model_namespace: str, group_idx: int, kind: str, sliding_window: int,
    block_size: int, block_bytes: int, dtype: str, layout: str,
) -> str:
    return msgspec.json.encode(
        [model_namespace, group_idx, kind, sliding_window, block_size, block_bytes, dtype, layout]
    ).decode()


class Pipe(Protocol):
    """The part of a redis pipeline the projection writes through (commands are queued)."""

    def hset(self, name: str, key: Any = None, value: Any = None, mapping: Any = None) -> Any: ...

    def hdel(self, name: str, *keys: Any) -> Any: ...

    def sadd(self, name: str, *values: Any) -> Any: ...

    def srem(self, name: str, *values: Any) -> Any: ...

    def delete(self, *names: str) -> Any: ...


_enc = msgspec.msgpack.Encoder()
_block_dec = msgspec.msgpack.Decoder(ProjectedBlock)
_entry_dec = msgspec.msgpack.Decoder(RestoredEntry)
ROW_HEADER = b"\x97"  # a row's first byte: a msgpack array of ProjectedBlock's 7 fields
decode_entry_unchecked = _entry_dec.decode  # a row known to start with ROW_HEADER (in C)
_layout_dec = msgspec.msgpack.Decoder(LayoutRecord)
_engine_dec = msgspec.msgpack.Decoder(EngineRecord)
_pos_dec = msgspec.msgpack.Decoder(tuple[int, int])


def encode(value: msgspec.Struct | tuple[int, int]) -> bytes:
    return _enc.encode(value)


def decode_block(data: bytes) -> ProjectedBlock:
    return _block_dec.decode(data)


def decode_entry(data: bytes) -> RestoredEntry:
    """A row as the tier entry it restores; ValueError when it is not an array of exactly
    ProjectedBlock's fields (more would fill the entry's own state)."""
    if data[:1] != ROW_HEADER:
        raise ValueError(f"not a projection row of {len(ProjectedBlock.__struct_fields__)} fields")
    return _entry_dec.decode(data)


def decode_layout(data: bytes) -> LayoutRecord:
    return _layout_dec.decode(data)


def decode_engine(data: bytes) -> EngineRecord:
    return _engine_dec.decode(data)


def decode_position(data: bytes) -> tuple[int, int]:
    return _pos_dec.decode(data)
