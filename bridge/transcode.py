"""Stored log record -> vLLM map-layout batch, without building the token and hash ints.

The bridge's publish path: most of a record is its ``token_ids`` and ``block_hashes`` arrays,
which a full decode turns into Python ints only for the encoder to turn them back into the same
msgpack bytes. Here they stay :class:`msgspec.Raw` slices of the stored record and are copied
through; every other field is decoded and type-checked. The output is byte-for-byte what
``codec_vllm.encode_batch(record.events, record.ts, source=record.source)`` produces (tests
check this); the full decode and schema validation of the record happen when the bridge applies
it to its state (bridge.state), which counts any problem as a violation.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

from events.codec_vllm import encode_batch
from events.records import decode_record
from events.schema import SchemaError

_NIL: Final = msgspec.Raw(b"\xc0")  # msgpack nil


class _InStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: msgspec.Raw
    parent_block_hash: int | None
    token_ids: msgspec.Raw
    block_size: int
    medium: str
    group_idx: int = 0
    kv_cache_spec_kind: str = "full_attention"
    sliding_window: int | None = None
    lora_name: str | None = None
    extra_keys: msgspec.Raw = _NIL


class _InRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: msgspec.Raw
    medium: str
    group_idx: int = 0


class _InCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    medium: str | None = None


class _InRecord(msgspec.Struct):
    offset: int
    source: str
    incarnation: int
    source_seq: int
    ts: float
    events: list[_InStored | _InRemoved | _InCleared]


# Output structs mirror codec_vllm's map layout field for field (same order, same defaults).
class _OutStored(msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True):
    block_hashes: msgspec.Raw
    parent_block_hash: int | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None
    medium: str
    lora_name: str | None
    extra_keys: msgspec.Raw | None = None
    group_idx: int | None = None  # defaults travel as None so that they are omitted, as vLLM does
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    source: str | None = None


class _OutRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True):
    block_hashes: msgspec.Raw
    medium: str
    group_idx: int | None = None
    source: str | None = None


class _OutCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", omit_defaults=True):
    medium: str | None = None
    source: str | None = None


class _OutBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int


class Transcoded(msgspec.Struct, frozen=True):
    offset: int
    source: str
    num_events: int
    payload: bytes


_DECODER: Final = msgspec.msgpack.Decoder(_InRecord)
_ENCODER: Final = msgspec.msgpack.Encoder()


def transcode_record(data: bytes, *, with_source: bool = True) -> Transcoded:
    """The vLLM map-layout batch of one stored record; SchemaError when it cannot be read."""
    try:
        record = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise SchemaError(f"log record: {exc}") from exc
    source = record.source if with_source else None
    out: list[Any] = []
    for e in record.events:
        if isinstance(e, _InStored):
            sliding = e.kv_cache_spec_kind == "sliding_window"
            keys = None if e.extra_keys == _NIL else e.extra_keys
            out.append(_OutStored(
                e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, None, e.medium,
                e.lora_name, keys, e.group_idx or None, e.kv_cache_spec_kind if sliding else None,
                e.sliding_window if sliding else None, source,
            ))
        elif isinstance(e, _InRemoved):
            out.append(_OutRemoved(e.block_hashes, e.medium, e.group_idx or None, source))
        else:
            out.append(_OutCleared(e.medium, source))
    payload = _ENCODER.encode(_OutBatch(record.ts, out, 0))
    return Transcoded(record.offset, record.source, len(out), payload)


def batch_for(data: bytes, layout: Literal["map", "legacy"]) -> Transcoded | None:
    """The batch the bridge publishes for one stored record; None when it cannot be read.

    The publisher, the replay server and the start-up scan all decide with this function which
    records take a seq (those with events that can be read), so their numbering agrees.
    """
    try:
        if layout == "map":
            return transcode_record(data)
        record = decode_record(data)  # the legacy layout is rare: the plain codec will do
    except SchemaError:
        return None
    payload = encode_batch(record.events, record.ts, layout="legacy")
    return Transcoded(record.offset, record.source, len(record.events), payload)


def takes_seq(batch: Transcoded | None, source: str | None) -> bool:
    """Whether a stream of ``source`` (None: every source) publishes this record.

    The wire never carries an empty batch, so a record without events takes no seq.
    """
    return batch is not None and batch.num_events > 0 and (source is None or batch.source == source)
