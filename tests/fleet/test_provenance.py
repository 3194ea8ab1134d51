"""BlockStored.provenance: kept by the protobuf and JSON-lines codecs and the log's storage
format, absent from the vLLM wire (whose bytes equal those of the same event without it)."""

from __future__ import annotations

import msgspec
import pytest

from events import codec_jsonl, records
from events.codec_proto import event_from_proto, event_to_proto
from events.codec_vllm import decode_batch, encode_batch
from events.schema import BlockStored, LogRecord

EV = BlockStored((7, 8), 6, tuple(range(8)), 4, "CPU", provenance="fleet:node-a")
PLAIN = msgspec.structs.replace(EV, provenance=None)


def test_proto_keeps_it() -> None:
    assert event_from_proto(event_to_proto(EV)) == EV
    assert event_from_proto(event_to_proto(PLAIN)) == PLAIN


def test_log_storage_and_jsonl_keep_it() -> None:
    record = LogRecord(1, "offloadd", 1, 1, 1.0, (EV,))
    assert records.decode_record(records.encode_record(record)) == record
    assert codec_jsonl.decode_record(codec_jsonl.encode_record(record)) == record


@pytest.mark.parametrize("layout", ["map", "legacy"])
def test_vllm_wire_leaves_it_out(layout: str) -> None:
    wire = encode_batch([EV], 1.0, layout=layout)  # type: ignore[arg-type]
    assert wire == encode_batch([PLAIN], 1.0, layout=layout)  # type: ignore[arg-type]
    assert b"provenance" not in wire and b"fleet" not in wire
    assert decode_batch(wire).events == (PLAIN,)
