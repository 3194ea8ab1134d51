"""JSON lines export: round trips and line-numbered errors."""

from __future__ import annotations

import io

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from events.codec_jsonl import decode_record, dump_records, encode_record, load_records
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, LogRecord, SchemaError
from tests.events.event_strategies import log_records


@given(st.lists(log_records, max_size=4))
def test_round_trip(records: list[LogRecord]) -> None:
    fp = io.StringIO()
    assert dump_records(records, fp) == len(records)
    text = fp.getvalue()
    assert text.count("\n") == len(records)
    assert list(load_records(io.StringIO(text))) == records


def test_line_format_and_tuples() -> None:
    ev = BlockStored((2**64 - 1,), None, (1,), 1, "CPU", extra_keys=(("ad", [1]),))
    record = LogRecord(3, "d", 1, 2, 1.5, (ev, AllBlocksCleared()))
    line = encode_record(record)
    assert line == (  # fields at their defaults are left out (DECISIONS 70)
        '{"offset":3,"source":"d","incarnation":1,"source_seq":2,"ts":1.5,"events":['
        '{"type":"BlockStored","block_hashes":[18446744073709551615],"parent_block_hash":null,'
        '"token_ids":[1],"block_size":1,"medium":"CPU","extra_keys":[["ad",[1]]]},'
        '{"type":"AllBlocksCleared","medium":null}]}'
    )
    want = BlockStored((2**64 - 1,), None, (1,), 1, "CPU", extra_keys=(("ad", (1,)),))
    assert decode_record(line).events[0] == want
    older = (  # every field written out, as archives before DECISIONS 70 hold them
        '{"offset":3,"source":"d","incarnation":1,"source_seq":2,"ts":1.5,"events":['
        '{"type":"BlockStored","block_hashes":[18446744073709551615],"parent_block_hash":null,'
        '"token_ids":[1],"block_size":1,"medium":"CPU","group_idx":0,'
        '"kv_cache_spec_kind":"full_attention","sliding_window":null,"lora_name":null,'
        '"extra_keys":[["ad",[1]]],"provenance":null},{"type":"AllBlocksCleared","medium":null}]}'
    )
    assert decode_record(older) == decode_record(line)


def test_errors_carry_line_numbers() -> None:
    good = encode_record(LogRecord(1, "e", 1, 1, 0.0, ()))
    bad_medium = good.replace(
        '"events":[]', '"events":[{"type":"AllBlocksCleared","medium":"TPU"}]'
    )
    text = f"{good}\n\n{good}\n{bad_medium}\n"
    records = load_records(io.StringIO(text))
    assert next(records).offset == 1 and next(records).offset == 1
    with pytest.raises(SchemaError) as err:
        next(records)
    assert str(err.value) == "line 4: Invalid enum value 'TPU' - at `$.events[0].medium`"
    short = encode_record(
        LogRecord(1, "e", 1, 1, 0.0, (BlockStored((1,), None, (1,), 1, "GPU"),))
    ).replace('"token_ids":[1]', '"token_ids":[]')
    with pytest.raises(SchemaError, match=r"^line 1: BlockStored.token_ids: expected 1 ids"):
        list(load_records([short]))
    with pytest.raises(SchemaError, match=r"^line 2: "):
        list(load_records(io.StringIO(good + "\n{not json\n")))
    with pytest.raises(SchemaError, match=r"^line 1: Object missing required field `source`"):
        list(load_records(['{"offset": 1}']))


def test_an_archive_header_is_read_first_and_skipped_by_load_records() -> None:
    from events.codec_jsonl import ARCHIVE_VERSION, ArchiveHeader, encode_header, load_file
    from events.state import Snapshot, SourceSnapshot

    stored = BlockStored((7,), None, (1, 2), 2, "GPU", extra_keys=(("lora", 1),))
    base = Snapshot(4, (SourceSnapshot("engine-a", 2, 9, (stored,)),))
    header = ArchiveHeader(ARCHIVE_VERSION, "default", "e1", 5, 1.5, base)
    record = LogRecord(5, "engine-a", 2, 10, 2.0, (BlockRemoved((7,), "GPU"),))
    text = encode_header(header) + "\n\n" + encode_record(record) + "\n"
    got, records = load_file(io.StringIO(text))
    assert got == header and list(records) == [record]
    assert list(load_records(io.StringIO(text))) == [record]
    assert load_file(io.StringIO(encode_record(record)))[0] is None  # a plain export
    with pytest.raises(SchemaError, match="line 4: an archive header after the first line"):
        list(load_records(io.StringIO(text + encode_header(header) + "\n")))
    wrong = msgspec.structs.replace(header, base=Snapshot(3, base.sources))
    with pytest.raises(SchemaError, match="line 1: archive header: base at offset 3, want 4"):
        load_file(io.StringIO(encode_header(wrong)))
