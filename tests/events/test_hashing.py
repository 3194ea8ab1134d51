"""Block hashes against an independent computation of the sha256_cbor definition.

The reference below encodes canonical CBOR by hand (RFC 8949 major types), so it shares no
code with events.hashing (which uses cbor2).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from events.extra_keys import MultiModalItem, RequestKeys
from events.hashing import (
    DEFAULT_SEED,
    BlockHasher,
    HashAlgo,
    _block_payloads,
    env_hash_seed,
    int_array,
    to_wire,
    to_wire_many,
)
from events.schema import BlockDigest


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for ai, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | ai]) + n.to_bytes(size, "big")
    raise ValueError(n)


def _cbor(value: object) -> bytes:
    if value is None:
        return b"\xf6"
    if isinstance(value, bytes):
        return _head(2, len(value)) + value
    if isinstance(value, str):
        raw = value.encode()
        return _head(3, len(raw)) + raw
    if isinstance(value, int):
        return _head(0, value) if value >= 0 else _head(1, -1 - value)
    if isinstance(value, list | tuple):
        return _head(4, len(value)) + b"".join(_cbor(v) for v in value)
    raise TypeError(value)


def _reference_chain(tokens: list[int], seed: str, block_size: int) -> list[int]:
    parent = hashlib.sha256(_cbor(seed)).digest()
    out = []
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(_cbor([parent, tokens[i : i + block_size], None])).digest()
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


def test_known_vector_first_block() -> None:
    # NONE_HASH for seed "0" is sha256 of CBOR text "0" (0x61 0x30).
    hasher = BlockHasher(seed="0", block_size=4)
    assert hasher.none_hash == hashlib.sha256(b"\x61\x30").digest()
    payload = b"\x83" + b"\x58\x20" + hasher.none_hash + b"\x84\x01\x02\x03\x04" + b"\xf6"
    (digest,) = hasher.hash_blocks([1, 2, 3, 4])
    assert digest == hashlib.sha256(payload).digest()


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    seed=st.text(max_size=8),
    block_size=st.integers(1, 17),
)
def test_sha256_cbor_matches_reference(tokens: list[int], seed: str, block_size: int) -> None:
    hasher = BlockHasher(seed=seed, block_size=block_size)
    got = [to_wire(d) for d in hasher.hash_blocks(tokens)]
    assert got == _reference_chain(tokens, seed, block_size)
    assert len(got) == len(tokens) // block_size


def test_partial_block_is_not_hashed() -> None:
    hasher = BlockHasher(block_size=16)
    assert hasher.hash_blocks(list(range(15))) == []
    assert len(hasher.hash_blocks(list(range(33)))) == 2


def test_chain_depends_on_parent_seed_and_extra_keys() -> None:
    a = BlockHasher(seed="a", block_size=2)
    b = BlockHasher(seed="b", block_size=2)
    assert a.hash_blocks([1, 2]) != b.hash_blocks([1, 2])
    assert a.hash_blocks([1, 2, 3, 4])[1] != a.hash_blocks([9, 9, 3, 4])[1]
    assert a.hash_blocks([1, 2], extra_keys=("lora",)) != a.hash_blocks([1, 2])


def test_xxh3_option() -> None:
    hasher = BlockHasher(seed="0", block_size=2, algo="xxh3_128_cbor")
    none = xxhash.xxh3_128_digest(_cbor("0"))
    (digest,) = hasher.hash_blocks([5, 6])
    assert digest == xxhash.xxh3_128_digest(_cbor([none, [5, 6], None]))
    assert len(digest) == 16


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        BlockHasher(algo="md5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(block_size=0)


_TOKEN = st.one_of(
    st.integers(0, 2**16 + 5),  # the table, and just past it
    st.integers(0, 2**64 + 5),  # every CBOR head size, and bignums (general path)
    st.integers(-5, -1),  # negative ids: CBOR major type 1 (general path)
    st.booleans(),  # hashed as int(True) == 1
)


@given(
    tokens=st.lists(_TOKEN, max_size=70),
    seed=st.text(max_size=4),
    block_size=st.integers(1, 20),
    algo=st.sampled_from(["sha256_cbor", "xxh3_128_cbor"]),
    parent=st.none() | st.binary(max_size=40),
)
def test_fast_path_matches_cbor2_path(
    tokens: list[int], seed: str, block_size: int, algo: str, parent: bytes | None
) -> None:
    hasher = BlockHasher(seed=seed, block_size=block_size, algo=algo)  # type: ignore[arg-type]
    want = hasher.hash_blocks_general(tokens, parent)
    assert hasher.hash_blocks(tokens, parent) == want
    assert len(want) == len(tokens) // block_size
    # The engine hands a checked prompt over as an int64 (or uint64) array.
    if all(0 <= t < 2**64 for t in tokens):
        for dtype in (np.int64, np.uint64):
            if all(t < np.iinfo(dtype).max for t in tokens):
                assert hasher.hash_blocks(np.array(tokens, dtype=dtype), parent) == want
    # One block of any length (hash_block takes what it is given) against cbor2.
    assert hasher.hash_block(parent, tokens) == hasher._hash_general(
        hasher.none_hash if parent is None else parent, tokens, None
    )


def test_fast_path_takes_what_int_takes() -> None:
    hasher = BlockHasher(block_size=2)
    assert hasher.hash_blocks([1.0, 2.0]) == hasher.hash_blocks([1, 2])  # type: ignore[list-item]
    assert hasher.hash_blocks(["70000", "3"]) == hasher.hash_blocks([70000, 3])  # type: ignore[list-item]
    assert hasher.hash_blocks([2**64, 1]) == hasher.hash_blocks_general([2**64, 1])
    assert hasher.hash_blocks([1, 2], extra_keys=("lora",)) == hasher.hash_blocks_general([1, 2], extra_keys=("lora",))


def test_digests_are_block_digests_and_to_wire_takes_their_last_8_bytes() -> None:
    hasher = BlockHasher(seed="0", block_size=2)
    digests: list[BlockDigest] = hasher.hash_blocks([1, 2, 3, 4])
    assert [len(d) for d in digests] == [32, 32]
    assert hasher.hash_block(digests[0], [3, 4]) == digests[1]
    assert to_wire(digests[1]) == int.from_bytes(digests[1][-8:], "big")


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxh3_128_cbor"])
def test_to_wire_many_is_to_wire_of_each(algo: HashAlgo) -> None:
    digests = BlockHasher(seed="0", block_size=4, algo=algo).hash_blocks(list(range(4 * 300)))
    assert to_wire_many(digests) == [to_wire(d) for d in digests]
    assert to_wire_many(digests[:1]) == [to_wire(digests[0])] and to_wire_many([]) == []
    # Mixed lengths (even ones that join to a multiple of one) and 8-byte digests: each read alone.
    mixed = [b"\x01" * 24 + (7).to_bytes(8, "big"), b"\x02" * 8 + (9).to_bytes(8, "big"), b"\x03" * 40 + (5).to_bytes(8, "big")]
    assert to_wire_many(mixed) == [7, 9, 5]
    assert to_wire_many([(5).to_bytes(8, "big"), (2**64 - 1).to_bytes(8, "big")]) == [5, 2**64 - 1]


def test_default_seed_is_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM without PYTHONHASHSEED: NONE_HASH = sha256(CBOR text "vllm-none-hash").
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert BlockHasher().none_hash == hashlib.sha256(_cbor("vllm-none-hash")).digest()
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # vLLM's init_none_hash follows it; so do we
    assert BlockHasher().seed == "0"
    assert BlockHasher(seed="x").seed == "x"  # an explicit seed wins
    assert env_hash_seed({}) == DEFAULT_SEED == "vllm-none-hash"
    assert env_hash_seed({"PYTHONHASHSEED": "0", "X": "1"}) == "0"
    assert env_hash_seed({"PYTHONHASHSEED": ""}) == ""  # set but empty is still set, as os.getenv


def test_hash_request_without_keys_is_hash_blocks() -> None:
    hasher = BlockHasher(block_size=3)
    tokens = list(range(20))
    assert hasher.hash_request(tokens) == hasher.hash_blocks(tokens)
    assert hasher.hash_request(tokens, RequestKeys(form="untagged")) == hasher.hash_blocks(tokens)
    assert hasher.hash_request(tokens[:2]) == []


def test_hash_request_keys_per_block() -> None:
    hasher = BlockHasher(block_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    none: bytes = hasher.none_hash

    def chain(keys: list[tuple[object, ...] | None]) -> list[bytes]:
        out: list[bytes] = []
        parent = none
        for i, k in enumerate(keys):
            parent = hashlib.sha256(_cbor([parent, tokens[2 * i : 2 * i + 2], k])).digest()
            out.append(parent)
        return out

    salt = RequestKeys(cache_salt="s")
    assert hasher.hash_request(tokens, salt) == chain([(("cache_salt", "s"),), None, None])
    lora = RequestKeys(lora_name="a", lora_path="/p", form="tagged")
    assert hasher.hash_request(tokens, lora) == chain([(("lora", "a", "/p"),)] * 3)
    mm = RequestKeys(mm_items=(MultiModalItem("img", 1, 2),), form="untagged")  # tokens 1-2
    assert hasher.hash_request(tokens, mm) == chain([(("img", 1),), (("img", -1),), None])
    fixed = RequestKeys(fixed=("k",))
    assert hasher.hash_request(tokens, fixed) == hasher.hash_blocks(tokens, extra_keys=("k",))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lora_path": "/p"}, "a LoRA path needs a LoRA name"),
        ({"lora_name": "a"}, "give the adapter's path"),
        ({"fixed": ("k",), "cache_salt": "s"}, "fixed extra keys exclude"),
        ({"form": "bare"}, "key form must be one of"),
        ({"mm_items": (MultiModalItem("a", 0, 4), MultiModalItem("b", 3, 1))}, "must be sorted and not overlap"),
    ],
)
def test_bad_request_keys_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RequestKeys(**kwargs)  # type: ignore[arg-type]


def test_bad_multimodal_item_is_refused() -> None:
    with pytest.raises(ValueError, match="offset must be >= 0 and length >= 1"):
        MultiModalItem("a", 0, 0)
    with pytest.raises(ValueError, match="needs an identifier"):
        MultiModalItem("", 0, 1)


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxh3_128_cbor"])
@pytest.mark.parametrize("block_size", [1, 16, 23, 24, 32])
def test_wire_hashes_of_every_id_width(algo: str, block_size: int) -> None:
    """The fast path (ids below 2**32: in the head, 1, 2 and 4 bytes after it; block heads of
    one and two bytes) and what leaves it (larger ids) give cbor2's digests, and
    ``wire_hashes`` their wire forms; lists and arrays alike, trailing partial blocks skipped."""
    rng = np.random.default_rng(block_size)
    hasher = BlockHasher("seed", block_size, algo)  # type: ignore[arg-type]
    ranges = [(0, 24), (24, 256), (256, 1 << 16), (1 << 16, 1 << 32), (1 << 32, 1 << 40)]
    for trial in range(24):
        picks = ranges if trial % 4 == 0 else ranges[:4]  # every 4th prompt leaves the fast path
        n = int(rng.integers(0, 9 * block_size + 3))
        ids = [int(rng.integers(*picks[int(rng.integers(len(picks)))])) for _ in range(n)]
        want = hasher.hash_blocks_general(ids)
        assert hasher.hash_blocks(ids) == hasher.hash_blocks(np.array(ids, dtype=np.int64)) == want
        assert hasher.wire_hashes(ids) == [to_wire(d) for d in want]
    edges = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1] * block_size
    assert hasher.hash_blocks(edges) == hasher.hash_blocks_general(edges)
    # Which inputs the fast path takes: ids in [0, 2**32), as a list or an integer array.
    assert _block_payloads(np.array(edges), block_size) is not None
    assert _block_payloads(np.array([*edges[:-1], 2**32]), block_size) is None
    assert _block_payloads(np.array([*edges[:-1], -1]), block_size) is None
    assert int_array([1.0, 2.0]) is None and int_array([True, 2]).tolist() == [1, 2]  # type: ignore[list-item, union-attr]
