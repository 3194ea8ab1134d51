"""The vLLM msgpack codec: round trips, hand-written payloads, and bad input."""

from __future__ import annotations

import contextlib
import re
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from events.codec_vllm import WireBatch, decode_batch, encode_batch
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, SchemaError
from tests.events.event_strategies import event_lists, names

pack = msgspec.msgpack.encode

STORED = BlockStored(
    block_hashes=(11, 2**64 - 1),
    parent_block_hash=7,
    token_ids=(1, 2, 3, 4),
    block_size=2,
    medium="GPU",
)


def stored_map(**over: Any) -> dict[str, Any]:
    event = {
        "type": "BlockStored",
        "block_hashes": [11, 2**64 - 1],
        "parent_block_hash": 7,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    event.update(over)
    return event


@given(events=event_lists, ts=st.floats(0, 2e9), dp=st.integers(0, 7), src=st.none() | names)
def test_map_round_trip(events: list[Any], ts: float, dp: int, src: str | None) -> None:
    got = decode_batch(encode_batch(events, ts, dp_rank=dp, source=src))
    assert got == WireBatch(ts, tuple(events), dp, tuple(src for _ in events))


@given(events=event_lists, ts=st.floats(0, 2e9), src=st.none() | names)
def test_legacy_round_trip(events: list[Any], ts: float, src: str | None) -> None:
    got = decode_batch(encode_batch(events, ts, layout="legacy", source=src))
    assert got == WireBatch(ts, tuple(events), 0, tuple(src for _ in events))


def test_map_layout_bytes_are_exactly_vllms() -> None:
    """Required keys always present (lora_id nil), optional ones omitted at their default."""
    sliding = BlockStored((5,), None, (9,), 1, "CPU", 1, "sliding_window", 4096, "ad", (("x",),))
    payload = encode_batch(
        [STORED, sliding, BlockRemoved((5,), "CPU"), AllBlocksCleared()], 1.5, dp_rank=3
    )
    assert msgspec.msgpack.decode(payload) == [
        1.5,
        [
            stored_map(),
            {
                "type": "BlockStored",
                "block_hashes": [5],
                "parent_block_hash": None,
                "token_ids": [9],
                "block_size": 1,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": "ad",
                "extra_keys": [["x"]],
                "group_idx": 1,
                "kv_cache_spec_kind": "sliding_window",
                "kv_cache_spec_sliding_window": 4096,
            },
            {"type": "BlockRemoved", "block_hashes": [5], "medium": "CPU"},
            {"type": "AllBlocksCleared"},
        ],
        3,
    ]


def test_window_only_for_sliding_window_groups() -> None:
    odd = BlockStored((5,), None, (9,), 1, "GPU", sliding_window=64)
    (event,) = msgspec.msgpack.decode(encode_batch([odd], 0.0))[1]
    assert "kv_cache_spec_sliding_window" not in event


def test_source_extension_on_every_event() -> None:
    payload = encode_batch([STORED, AllBlocksCleared("CPU")], 2.0, source="engine-a")
    events = msgspec.msgpack.decode(payload)[1]
    assert [e["source"] for e in events] == ["engine-a", "engine-a"]
    assert events[1] == {"type": "AllBlocksCleared", "medium": "CPU", "source": "engine-a"}


def test_legacy_layout_is_positional() -> None:
    payload = encode_batch(
        [STORED, BlockRemoved((11,), "GPU", 2), AllBlocksCleared()], 3.0, layout="legacy"
    )
    assert msgspec.msgpack.decode(payload) == [
        3.0,
        [
            [
                "BlockStored",
                [11, 2**64 - 1],
                7,
                [1, 2, 3, 4],
                2,
                None,
                "GPU",
                None,
                None,
                0,
                "full_attention",
                None,
            ],
            ["BlockRemoved", [11], "GPU", 2],
            ["AllBlocksCleared"],
        ],
        0,
    ]


def test_decode_hand_written_map_payload() -> None:
    payload = pack(
        [
            1700000000,  # an int ts is accepted as a float
            [
                stored_map(
                    extra_keys=[None, ["lora", 3]],
                    locality="node-1",  # optional vLLM keys we do not model: ignored
                    session_id="s",
                    future_key={"nested": [1]},  # unknown key: ignored
                    source="eng",
                ),
                {"type": "BlockRemoved", "block_hashes": [11], "medium": "CPU", "group_idx": 1},
                {"type": "AllBlocksCleared"},
            ],
            None,  # vLLM omits or nils data_parallel_rank without DP
        ]
    )
    assert decode_batch(payload) == WireBatch(
        1700000000.0,
        (
            BlockStored((11, 2**64 - 1), 7, (1, 2, 3, 4), 2, "GPU", extra_keys=(None, ("lora", 3))),
            BlockRemoved((11,), "CPU", 1),
            AllBlocksCleared(),
        ),
        0,
        ("eng", None, None),
    )


def test_decode_two_element_batch_and_nil_optionals() -> None:
    event = stored_map(
        extra_keys=None,
        group_idx=None,
        kv_cache_spec_kind=None,
        kv_cache_spec_sliding_window=None,
        source=None,
    )
    removed: dict[str, Any] = {
        "type": "BlockRemoved",
        "block_hashes": [],
        "medium": "CPU",
        "group_idx": None,
    }
    legacy = ["BlockStored", [11, 2**64 - 1], 7, [1, 2, 3, 4], 2, None, "GPU", None, None, None]
    legacy += [None, None]  # vLLM's array-like structs write every default, nil included
    got = decode_batch(pack([0.5, [event, removed, legacy]]))
    assert got == WireBatch(0.5, (STORED, BlockRemoved((), "CPU"), STORED), 0, (None,) * 3)


def test_decode_hand_written_legacy_and_mixed_payload() -> None:
    payload = pack(
        [
            2.0,
            [
                ["BlockStored", [1], None, [5, 6], 2, None, "CPU"],  # old vLLM: no lora_name
                [
                    "BlockStored",
                    [2],
                    1,
                    [7],
                    1,
                    None,
                    "GPU",
                    "ad",
                    [["k"]],
                    1,
                    "sliding_window",
                    128,
                    "src",
                    "future element",
                ],  # source, then an element from the future
                ["BlockRemoved", [1], "CPU"],
                ["AllBlocksCleared"],
                {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU", "group_idx": 1},
            ],
            1,
        ]
    )
    assert decode_batch(payload) == WireBatch(
        2.0,
        (
            BlockStored((1,), None, (5, 6), 2, "CPU"),
            BlockStored((2,), 1, (7,), 1, "GPU", 1, "sliding_window", 128, "ad", (("k",),)),
            BlockRemoved((1,), "CPU"),
            AllBlocksCleared(),
            BlockRemoved((2,), "GPU", 1),
        ),
        1,
        (None, "src", None, None, None),
    )


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ({k: v for k, v in stored_map().items() if k != "medium"}, "BlockStored: missing required key 'medium'"),
        ({k: v for k, v in stored_map().items() if k != "lora_id"}, "BlockStored: missing required key 'lora_id'"),
        ({k: v for k, v in stored_map().items() if k != "parent_block_hash"}, "BlockStored: missing required key 'parent_block_hash'"),
        ({"type": "BlockRemoved", "medium": "GPU"}, "BlockRemoved: missing required key 'block_hashes'"),
        (["BlockStored", [1], None, [5], 1, None], "BlockStored: missing required key 'medium'"),
        (["BlockRemoved", [1]], "BlockRemoved: missing required key 'medium'"),
        (["BlockRemoved", [1], 5], "BlockRemoved.medium: Expected `str`, got `int`"),
        (["BlockStored", [1], None, [5], "1", None, "GPU"], "BlockStored.block_size: Expected `int`, got `str`"),
        ({"type": "Bogus"}, "event 0: unknown or missing event type 'Bogus'"),
        ({"block_hashes": [1]}, "event 0: unknown or missing event type None"),
        (["Bogus", 1], "event 0: unknown or missing event type 'Bogus'"),
        (7, "event 0: expected a map or an array, got int"),
    ],
)  # fmt: skip
def test_missing_or_unknown_is_refused_by_name(event: Any, message: str) -> None:
    with pytest.raises(SchemaError) as err:
        decode_batch(pack([1.0, [event], 0]))
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ({"medium": "TPU"}, "BlockStored.medium: must be 'GPU' or 'CPU', got 'TPU'"),
        ({"medium": None}, "BlockStored.medium: Expected `str`, got `None`"),
        ({"token_ids": [1, 2, 3]}, "BlockStored.token_ids: expected 4 ids"),
        ({"block_hashes": [-1, 2]}, "block_hashes: -1 is not an unsigned 64-bit hash"),
        ({"block_size": "2"}, "BlockStored.block_size: Expected `int`, got `str`"),
        ({"block_hashes": [1, "x"]}, "BlockStored.block_hashes: Expected `int`, got `str`"),
        ({"kv_cache_spec_kind": "mamba"}, "BlockStored.kv_cache_spec_kind: unknown kind 'mamba'"),
    ],
)
def test_bad_values_are_refused_by_name(override: dict[str, Any], fragment: str) -> None:
    with pytest.raises(SchemaError, match="^" + re.escape(fragment)):
        decode_batch(pack([1.0, [stored_map(**override)], 0]))


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        b"\x93\xcb",  # truncated
        pack({"ts": 1.0}),
        pack([1.0]),
        pack(["x", [], 0]),
        pack([1.0, "events", 0]),
        pack([1.0, [[]], 0]),
        pack([1.0, [{"type": ["unhashable"]}], 0]),
    ],
)
def test_garbage_is_a_schema_error(payload: bytes) -> None:
    with pytest.raises(SchemaError):
        decode_batch(payload)


@given(st.binary(max_size=64))
def test_random_bytes_never_raise_anything_but_schema_error(payload: bytes) -> None:
    with contextlib.suppress(SchemaError):
        decode_batch(payload)


def test_unknown_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown layout 'xml'"):
        encode_batch([STORED], 0.0, layout="xml")  # type: ignore[arg-type]
