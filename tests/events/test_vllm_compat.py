"""Compatibility with vLLM's own msgspec schema, mirrored here from shared/docs/WIRE.md.

The structs (tests/events/vllm_schema.py) are written the way vLLM declares them. Our codec's
bytes must decode under them with equal values, and their bytes must decode under our codec.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from events.codec_vllm import WireBatch, decode_batch, encode_batch
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, Event
from tests.events.event_strategies import event_lists
from tests.events.vllm_schema import (
    KVEventBatch,
    LAllBlocksCleared,
    LBlockRemoved,
    LBlockStored,
    LegacyBatch,
    VAllBlocksCleared,
    VBlockRemoved,
    VBlockStored,
)

# -- converting between their structs and our domain, field by field ------------------------------


def _lists(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [_lists(v) for v in value]
    return value


def _theirs(event: Event, legacy: bool) -> Any:
    """The vLLM struct carrying the same values as our domain event."""
    if isinstance(event, BlockStored):
        sliding = event.kv_cache_spec_kind == "sliding_window"
        cls = LBlockStored if legacy else VBlockStored
        return cls(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=None,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=_lists(event.extra_keys),
            group_idx=event.group_idx if legacy or event.group_idx else None,
            kv_cache_spec_kind=event.kv_cache_spec_kind if legacy or sliding else None,
            kv_cache_spec_sliding_window=event.sliding_window if sliding else None,
        )
    if isinstance(event, BlockRemoved):
        if legacy:
            return LBlockRemoved(list(event.block_hashes), event.medium, event.group_idx)
        return VBlockRemoved(list(event.block_hashes), event.medium, event.group_idx or None)
    return LAllBlocksCleared() if legacy else VAllBlocksCleared()


def _comparable(events: list[Event]) -> list[Event]:
    """vLLM's AllBlocksCleared has no medium: it means every tier."""
    return [AllBlocksCleared() if isinstance(e, AllBlocksCleared) else e for e in events]


@given(events=event_lists, ts=st.floats(0, 2e9), dp=st.integers(0, 7))
def test_our_map_batch_decodes_under_vllm_schema(events: list[Event], ts: float, dp: int) -> None:
    theirs = msgspec.msgpack.decode(encode_batch(events, ts, dp_rank=dp), type=KVEventBatch)
    want = [_theirs(e, legacy=False) for e in _comparable(events)]
    assert theirs == KVEventBatch(ts, want, dp)


@given(events=event_lists, ts=st.floats(0, 2e9), dp=st.integers(0, 7))
def test_vllm_map_batch_decodes_under_ours(events: list[Event], ts: float, dp: int) -> None:
    events = _comparable(events)
    batch = KVEventBatch(ts, [_theirs(e, legacy=False) for e in events], dp or None)
    got = decode_batch(msgspec.msgpack.encode(batch))
    assert got == WireBatch(ts, tuple(events), dp, tuple(None for _ in events))


@given(events=event_lists, ts=st.floats(0, 2e9))
def test_our_legacy_batch_decodes_under_vllm_legacy_schema(events: list[Event], ts: float) -> None:
    payload = encode_batch(events, ts, layout="legacy")
    theirs = msgspec.msgpack.decode(payload, type=LegacyBatch)
    assert theirs == LegacyBatch(ts, [_theirs(e, legacy=True) for e in _comparable(events)], 0)


@given(events=event_lists, ts=st.floats(0, 2e9))
def test_vllm_legacy_batch_decodes_under_ours(events: list[Event], ts: float) -> None:
    events = _comparable(events)
    batch = LegacyBatch(ts, [_theirs(e, legacy=True) for e in events], 0)
    got = decode_batch(msgspec.msgpack.encode(batch))
    assert got == WireBatch(ts, tuple(events), 0, tuple(None for _ in events))


def test_source_and_medium_extensions_are_ignored_by_vllm() -> None:
    events: list[Event] = [BlockRemoved((1,), "CPU"), AllBlocksCleared("GPU")]
    for layout, schema in (("map", KVEventBatch), ("legacy", LegacyBatch)):
        payload = encode_batch(events, 1.0, layout=layout, source="engine-7")  # type: ignore[arg-type]
        theirs: Any = msgspec.msgpack.decode(payload, type=schema)
        assert len(theirs.events) == 2
        assert [type(e).__name__[1:] for e in theirs.events] == [
            "BlockRemoved",
            "AllBlocksCleared",
        ]
        assert decode_batch(payload).sources == ("engine-7", "engine-7")
