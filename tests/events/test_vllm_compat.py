"""Compatibility with vLLM: its msgspec schema (mirrored from shared/docs/WIRE.md) and its
block hashes (re-implemented below from vLLM's source).

The structs (tests/events/vllm_schema.py) are written the way vLLM declares them. Our codec's
bytes must decode under them with equal values, and their bytes must decode under our codec.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from events.codec_vllm import WireBatch, decode_batch, encode_batch
from events.extra_keys import MultiModalItem, RequestKeys
from events.hashing import DEFAULT_SEED, BlockHasher, env_hash_seed, to_wire
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, Event
from tests.events.event_strategies import event_lists
from tests.events.test_hashing import _cbor
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


# -- block hashes: vLLM's own hashing, re-implemented from its source ------------------------------
#
# vllm/v1/core/kv_cache_utils.py (vllm-project/vllm main, the version that introduced
# DEFAULT_NONE_HASH_SEED; read for this test):
#   resolve_none_hash_seed(fn): os.getenv("PYTHONHASHSEED") if set, else DEFAULT_NONE_HASH_SEED
#       = "vllm-none-hash" (os.urandom for the non-cryptographic xxhash functions);
#   init_none_hash(fn): NONE_HASH = fn(seed);   sha256_cbor(x) = sha256(cbor2.dumps(x, canonical=True))
#   hash_block_tokens(fn, parent, tokens, extra_keys) = fn((parent or NONE_HASH, tuple(tokens), extra_keys))
#   generate_block_hash_extra_keys: lora_keys + mm_keys + cache_salt_keys (+ prompt-embeds keys),
#       the salt only when start_token_idx == 0; None when empty;
#   _gen_mm_extra_hash_keys: walks the offset-sorted items from curr_mm_idx, appending
#       (identifier, offset - start_token_idx) for each item the block overlaps.
# That source mixes in bare values; vLLM 0.33 tags them (WIRE.md "Hash compatibility"; the
# domain tags of vllm-project/vllm issue 44701 / PR 44706, with the adapter's path in the LoRA
# tag): ("lora", name, path), ("mm", identifier, offset), ("cache_salt", salt).
# The CBOR here is test_hashing's hand-written encoder: no code shared with events.hashing.


@dataclass
class _VllmRequest:
    """The fields of vllm.v1.request.Request the extra-key functions read."""

    all_token_ids: list[int]
    lora: tuple[str, str] | None = None  # (lora_name, lora_path)
    cache_salt: str | None = None
    mm: list[tuple[str, int, int]] | None = None  # (identifier, offset, length), sorted


def _vllm_seed(env: dict[str, str]) -> str:
    return env.get("PYTHONHASHSEED", "vllm-none-hash")


def _vllm_mm_keys(req: _VllmRequest, start: int, end: int, idx: int, tagged: bool) -> tuple[list[Any], int]:
    keys: list[Any] = []
    feats = req.mm or []
    if not feats or feats[-1][1] + feats[-1][2] <= start:
        return keys, idx
    while idx < len(feats):
        ident, offset, length = feats[idx]
        if end > offset:
            if start >= offset + length:
                idx += 1
                continue
            keys.append(("mm", ident, offset - start) if tagged else (ident, offset - start))
            if end >= offset + length:
                idx += 1
            else:
                break
        else:
            break
    return keys, idx


def _vllm_block_hashes(req: _VllmRequest, block_size: int, seed: str, tagged: bool) -> list[int]:
    def sha256_cbor(obj: Any) -> bytes:
        return hashlib.sha256(_cbor(obj)).digest()

    none_hash = sha256_cbor(seed)
    parent: bytes | None = None
    out, start, mm_idx = [], 0, 0
    while start + block_size <= len(req.all_token_ids):
        end = start + block_size
        mm_keys, mm_idx = _vllm_mm_keys(req, start, end, mm_idx, tagged)
        lora_keys: list[Any] = []
        if req.lora is not None:
            lora_keys = [("lora", *req.lora)] if tagged else [req.lora[0]]
        salt_keys: list[Any] = []
        if start == 0 and req.cache_salt:
            salt_keys = [("cache_salt", req.cache_salt)] if tagged else [req.cache_salt]
        extra = lora_keys + mm_keys + salt_keys
        parent = sha256_cbor((parent or none_hash, tuple(req.all_token_ids[start:end]), tuple(extra) or None))
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))  # maybe_convert_block_hash
        start = end
    return out


def _ours(req: _VllmRequest, block_size: int, seed: str, tagged: bool) -> list[int]:
    keys = RequestKeys(
        lora_name=req.lora[0] if req.lora else None,
        lora_path=req.lora[1] if req.lora else None,
        cache_salt=req.cache_salt,
        mm_items=tuple(MultiModalItem(*m) for m in req.mm or ()),
        form="tagged" if tagged else "untagged",
    )
    hasher = BlockHasher(seed=seed, block_size=block_size)
    return [to_wire(d) for d in hasher.hash_request(req.all_token_ids, keys)]


def test_default_seed_is_vllms_and_follows_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert DEFAULT_SEED == "vllm-none-hash"
    assert env_hash_seed({}) == "vllm-none-hash" == _vllm_seed({})
    assert env_hash_seed({"PYTHONHASHSEED": "0"}) == "0" == _vllm_seed({"PYTHONHASHSEED": "0"})
    hasher = BlockHasher()
    assert hasher.none_hash == hashlib.sha256(b"\x6e" + b"vllm-none-hash").digest()  # CBOR text(14)


# Known answers, computed once with the reference above (sha256_cbor, block size 4, tokens
# 0..11): a change in any of them means our hashes no longer equal a vLLM engine's.
KNOWN_ANSWERS = {
    "plain": [1088283741995145368, 1498344643476930809, 4496890012247391769],
    "salt": [3948774793213223007, 5099481285874297975, 1054452604254408973],
    "lora": [9792657989005646299, 2119157055388999934, 13962966127524457491],
    "lora+salt untagged": [16390724458918653604, 9347039520149390201, 1272410250330761426],
}


def _known_requests() -> dict[str, tuple[_VllmRequest, bool]]:
    tokens = list(range(12))
    return {
        "plain": (_VllmRequest(tokens), True),
        "salt": (_VllmRequest(tokens, cache_salt="tenant-a"), True),
        "lora": (_VllmRequest(tokens, lora=("sql", "/adapters/sql")), True),
        "lora+salt untagged": (_VllmRequest(tokens, lora=("sql", "/adapters/sql"), cache_salt="t"), False),
    }


@pytest.mark.parametrize("name", sorted(KNOWN_ANSWERS))
def test_known_answers(name: str) -> None:
    req, tagged = _known_requests()[name]
    reference = _vllm_block_hashes(req, 4, DEFAULT_SEED, tagged)
    assert reference == KNOWN_ANSWERS[name]
    assert _ours(req, 4, DEFAULT_SEED, tagged) == reference


_MM = st.lists(st.tuples(st.integers(0, 6), st.integers(1, 9)), max_size=4)


@given(
    n_tokens=st.integers(0, 40),
    block_size=st.integers(1, 8),
    lora=st.none() | st.tuples(st.text(min_size=1, max_size=4), st.text(min_size=1, max_size=6)),
    salt=st.none() | st.text(min_size=1, max_size=5),
    gaps=_MM,
    tagged=st.booleans(),
    seed=st.sampled_from([DEFAULT_SEED, "0", "1234"]),
)
def test_extra_keys_hash_as_vllm_places_them(
    n_tokens: int, block_size: int, lora: tuple[str, str] | None, salt: str | None,
    gaps: list[tuple[int, int]], tagged: bool, seed: str,
) -> None:
    mm, at = [], 0
    for i, (gap, length) in enumerate(gaps):  # sorted, non-overlapping items
        mm.append((f"img{i}", at + gap, length))
        at += gap + length
    req = _VllmRequest(list(range(100, 100 + n_tokens)), lora, salt, mm)
    want = _vllm_block_hashes(req, block_size, seed, tagged)
    assert _ours(req, block_size, seed, tagged) == want
    assert len(want) == n_tokens // block_size
