"""What kv-ingest accepts from a publisher: both replay reply shapes, both batch encodings,
vLLM's nil medium, media the log has no tier for; everything else is Garbage of a kind."""

from __future__ import annotations

import msgspec
import pytest

from events.schema import BlockRemoved, BlockStored
from events.wire_frames import END_SEQ
from ingest.errors import Garbage
from ingest.wire import Frame, decode, parse_live, parse_reply

ENC = msgspec.msgpack.Encoder()
STORED = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
          "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None}


def test_live_frames_and_publisher_identity() -> None:
    assert parse_live([b"t", (5).to_bytes(8, "big"), b"p"], b"t") == Frame(5, b"p")
    ident = bytes(range(16))
    assert parse_live([b"", (5).to_bytes(8, "big") + ident, b"p"], b"") == Frame(5, b"p", ident)
    for frames, kind in [([b"t", b"p"], "frame_count"), ([b"x", (1).to_bytes(8, "big"), b"p"], "topic"),
                         ([b"t", b"\x00" * 9, b"p"], "seq_frame"), ([b"t", END_SEQ, b"p"], "seq_frame")]:
        with pytest.raises(Garbage) as info:
            parse_live(frames, b"t")
        assert info.value.kind == kind


def test_replies_with_and_without_the_topic_frame() -> None:
    seq = (3).to_bytes(8, "big")
    assert parse_reply([b"", b"topic", seq, b"p"]) == Frame(3, b"p")
    assert parse_reply([b"", seq, b"p"]) == Frame(3, b"p")  # vLLM before 0.33
    assert parse_reply([b"", b"", END_SEQ, b""]) is None
    assert parse_reply([b"", END_SEQ, b""]) is None
    with pytest.raises(Garbage):
        parse_reply([b"x", seq, b"p"])


def test_batches_as_arrays_or_maps_with_nil_and_foreign_media() -> None:
    storage = {**STORED, "block_hashes": [8], "medium": "STORAGE"}
    nil = {**STORED, "block_hashes": [9], "medium": None}
    removed = {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"}
    batch = decode(ENC.encode({"ts": 1.5, "events": [STORED, storage, nil, removed],
                               "data_parallel_rank": 2}))
    assert batch.dp_rank == 2 and batch.ts == 1.5 and batch.num_skipped == 1
    assert [type(e) for e in batch.events] == [BlockStored, BlockStored, BlockRemoved]
    assert [e.medium for e in batch.events] == ["GPU", "GPU", "CPU"]
    legacy = decode(ENC.encode([2.0, [["BlockRemoved", [7], None]], 0]))
    assert legacy.events == (BlockRemoved((7,), "GPU"),)
    assert decode(ENC.encode([2.0, [], 0])).events == ()  # an empty batch: a heartbeat


@pytest.mark.parametrize("payload", [b"\xc1", ENC.encode([1.0]), ENC.encode("batch"),
                                     ENC.encode([1.0, [{**STORED, "token_ids": [1]}], 0]),
                                     ENC.encode([1.0, [{"type": "Nope"}], 0])])
def test_undecodable_payloads_are_garbage(payload: bytes) -> None:
    with pytest.raises(Garbage) as info:
        decode(payload)
    assert info.value.kind == "payload"
