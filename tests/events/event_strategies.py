"""Hypothesis strategies for valid domain events and log records (valid per validate_event)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from events.schema import (
    MAX_HASH,
    SPEC_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    LogRecord,
    validate_event,
)

hashes = st.integers(0, MAX_HASH)
media = st.sampled_from(("GPU", "CPU"))
tokens = st.integers(0, 2**32 - 1)  # proto carries uint32 token ids
names = st.text(max_size=6)

# extra_keys entries: None or an array of JSON/CBOR/msgpack-friendly scalars (nested once).
_scalar = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | names
_array = st.lists(_scalar | st.lists(_scalar, max_size=2).map(tuple), max_size=3).map(tuple)
extra_key_entries = st.none() | _array


@st.composite
def block_stored(draw: st.DrawFn, medium: Any = media) -> BlockStored:
    n = draw(st.integers(1, 4))
    bs = draw(st.integers(1, 4))
    kind = draw(st.sampled_from(SPEC_KINDS))
    window = draw(st.integers(1, 2**31)) if kind == "sliding_window" else None
    extra = draw(st.none() | st.lists(extra_key_entries, min_size=n, max_size=n).map(tuple))
    event = BlockStored(
        block_hashes=tuple(draw(st.lists(hashes, min_size=n, max_size=n))),
        parent_block_hash=draw(st.none() | hashes),
        token_ids=tuple(draw(st.lists(tokens, min_size=n * bs, max_size=n * bs))),
        block_size=bs,
        medium=draw(medium),
        group_idx=draw(st.integers(0, 3)),
        kv_cache_spec_kind=kind,
        sliding_window=window,
        lora_name=draw(st.none() | names),
        extra_keys=extra,
    )
    validate_event(event)
    return event


block_removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hashes, max_size=4).map(tuple),
    medium=media,
    group_idx=st.integers(0, 3),
)
all_cleared = st.builds(AllBlocksCleared, medium=st.none() | media)
events: st.SearchStrategy[Event] = block_stored() | block_removed | all_cleared
event_lists = st.lists(events, max_size=5)

log_records = st.builds(
    LogRecord,
    offset=st.integers(1, 2**63),
    source=names,
    incarnation=st.integers(0, 2**40),
    source_seq=st.integers(0, 2**40),
    ts=st.floats(0, 2e9, allow_nan=False),
    events=event_lists.map(tuple),
)
