"""The bridge's pieces on their own: seq index, request frames, log reader, saved position."""

from __future__ import annotations

import pytest
import redis

from bridge.config import BridgeConfig, config_from_args
from bridge.errors import BridgeConfigError, BridgeError, PeerGone, SeqIndexError
from bridge.position import PositionStore, SavedPosition
from bridge.seqindex import SeqIndex
from bridge.transcode import batch_for, relayout, takes_seq, transcode_record
from events.codec_vllm import encode_batch
from events.logkeys import LogKeys
from events.logreader import LogReader, LogUnavailable
from events.records import RECORD_FIELD, encode_record
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, LogRecord, SchemaError
from events.wire_frames import END_SEQ, BadRequest, ReplayRequest, parse_request, seq_bytes
from tests.support.bridge_proc import FleetSimulator, LogWriter
from tests.support.redis_proc import RedisProcess

TRANSIENT = (redis.ConnectionError, redis.TimeoutError)


def test_seq_index_maps_runs_of_offsets() -> None:
    index = SeqIndex()
    for offset in (1, 2, 3, 7, 8, 12):
        index.append(offset)
    assert [index.offset_of(s) for s in range(6)] == [1, 2, 3, 7, 8, 12]
    assert (index.next_seq, index.last_offset, len(index)) == (6, 12, 6)
    assert [index.count_through(o) for o in (0, 1, 3, 5, 7, 11, 12, 99)] == [0, 1, 3, 3, 4, 5, 6, 6]
    index.rebase(100)
    assert (index.base_seq, index.next_seq, index.offset_of(103)) == (100, 106, 7)
    with pytest.raises(ValueError, match="seq 99 is not in"):
        index.offset_of(99)
    with pytest.raises(ValueError, match="offsets must grow"):
        index.append(12)


def test_mixed_stream_is_one_run() -> None:
    index = SeqIndex()
    for offset in range(1, 100_001):
        index.append(offset)
    assert index._run_seqs == [0]
    assert index.offset_of(54_321) == 54_322


def test_parse_request() -> None:
    assert parse_request([b"id", b"", seq_bytes(7)]) == ReplayRequest(b"id", 7)
    assert parse_request([b"id", b"", b"snapshot"]) == ReplayRequest(b"id", None)
    assert parse_request([b"id", b"", seq_bytes(0), b"kv@a"]) == ReplayRequest(b"id", 0, b"kv@a")
    for frames, message in [
        ([b"id", seq_bytes(1)], "expected 3 or 4 frames, got 2"),
        ([b"id", b"x", seq_bytes(1)], "expected an empty delimiter frame"),
        ([b"id", b"", b"abc"], "start_seq must be 8 bytes, got 3"),
        ([b"id", b"", END_SEQ], "start_seq is the end marker"),
        ([b"id", b"", b"", b"", b""], "expected 3 or 4 frames, got 5"),
    ]:
        with pytest.raises(BadRequest, match=message):
            parse_request(frames)


def test_log_reader_ranges_poll_and_head(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    reader = LogReader(client, LogKeys(), TRANSIENT)
    assert (reader.head(), reader.first_offset(), reader.poll(0, 10)) == (0, 0, [])
    records = FleetSimulator(["a", "b"], seed=9).write(LogWriter(client), 25)
    assert reader.head() == 25 and reader.first_offset() == 1
    assert reader.read_range(5, 9) == records[4:9]
    assert reader.read_range(20, None, count=3) == records[19:22]
    assert list(reader.iter_range(1, None, chunk=7)) == records
    assert list(reader.iter_range(24, 30)) == records[23:]
    assert reader.poll(23, 10) == records[23:]
    assert reader.poll(25, 10) == []
    follow = reader.follow(25, block_ms=10)  # from offset 25 on
    assert next(follow) == records[24]
    client.delete(LogKeys().head)  # a log without the head key: the last entry decides
    assert reader.head() == 25
    client.xadd(LogKeys().log, {b"x": b"1"}, id="26-0")
    with pytest.raises(SchemaError, match="no field b'r'"):
        reader.read_range(26)
    client.xadd(LogKeys().log, {RECORD_FIELD: b"\x01\x02"}, id="27-0")
    with pytest.raises(SchemaError, match="log record"):
        reader.read_range(27)
    client.close()


def test_log_reader_reports_redis_down(own_redis: RedisProcess) -> None:
    client = redis.Redis.from_url(own_redis.url, socket_connect_timeout=0.5)
    reader = LogReader(client, LogKeys(), TRANSIENT)
    own_redis.stop()
    with pytest.raises(LogUnavailable, match="redis unavailable"):
        reader.head()
    own_redis.start()
    assert reader.head() == 0
    client.close()


def test_position_store_round_trip(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    store = PositionStore(client, LogKeys().bridge("b1"), TRANSIENT)
    assert store.load() is None
    store.save(SavedPosition(42, {"kv-events": 40, "kv@a": 7}))
    assert store.load() == SavedPosition(42, {"kv-events": 40, "kv@a": 7})
    client.hset(LogKeys().bridge("b1"), "offset", "junk")
    assert store.load() is None
    client.close()


def test_config_from_flags_and_env() -> None:
    env = {"REDIS_URL": "redis://r:1/0", "KVB_TOPIC": "test", "KVB_HWM": "5", "KVB_PER_SOURCE": ""}
    cfg = config_from_args(["--layout", "legacy", "--metrics-port", "0"], env)
    assert cfg == BridgeConfig(redis_url="redis://r:1/0", topic="test", hwm=5, layout="legacy",
                               metrics_port=0)
    cfg = config_from_args(["--per-source", "--topic", "kv@{source}"], {})
    assert cfg.topic_for("e1") == "kv@e1"
    with pytest.raises(ValueError, match="choose either --source or --per-source"):
        BridgeConfig(source="a", per_source=True, topic="kv@{source}")
    with pytest.raises(ValueError, match=r"a topic with \{source\} needs --per-source"):
        BridgeConfig(topic="kv@{source}")
    # a bad value names its variable or flag (was: "invalid literal for int()", one message for three flags)
    with pytest.raises(BridgeConfigError, match=r"^KVB_HWM='abc' is not an integer$"):
        config_from_args([], {"KVB_HWM": "abc"})
    with pytest.raises(BridgeConfigError, match=r"^--max-pending must be >= 0, got -2$"):
        config_from_args(["--max-pending", "-2"], {})
    # a port past 65535 was an OverflowError traceback from the HTTP server's bind
    with pytest.raises(BridgeConfigError, match=r"^--metrics-port must be in 0..65535, got 99999$"):
        config_from_args(["--metrics-port", "99999"], {})


def test_config_of_vllm_compatibility_options() -> None:
    env = {"KVB_LEGACY_PUB": "tcp://*:6557", "KVB_LEGACY_REPLAY": "tcp://*:6558"}
    cfg = config_from_args(["--per-source", "--topic", "kv@{source}", "--default-source", "e0"], env)
    assert (cfg.default_source, cfg.legacy_pub_endpoint, cfg.legacy_replay_endpoint) == (
        "e0", "tcp://*:6557", "tcp://*:6558")
    assert config_from_args(["--topic", ""], {}).topic == ""  # vLLM's topic
    with pytest.raises(BridgeConfigError, match="--default-source is for --per-source mode"):
        config_from_args(["--default-source", "e0"], {})
    with pytest.raises(BridgeConfigError, match="give both --legacy-pub and --legacy-replay"):
        config_from_args(["--legacy-pub", "tcp://*:1"], {})
    with pytest.raises(BridgeConfigError, match="already publishes the legacy layout"):
        config_from_args(["--layout", "legacy"], env)


def test_relayout_keeps_the_batch() -> None:
    events = (BlockStored((1, 2), None, (1, 2, 3, 4), 2, "GPU"), AllBlocksCleared())
    payload = encode_batch(events, 2.5, dp_rank=3, source="e")
    legacy = relayout(payload, "legacy")
    assert legacy == encode_batch(events, 2.5, layout="legacy", dp_rank=3)
    assert relayout(legacy, "map") == encode_batch(events, 2.5, dp_rank=3)
    assert relayout(payload, "map") == payload


def _special_records() -> list[LogRecord]:
    return [
        LogRecord(1, "x", 1, 1, 1.5, (
            BlockStored((1, 2), 5, (1, 2, 3, 4), 2, "CPU", group_idx=1,
                        kv_cache_spec_kind="sliding_window", sliding_window=128, lora_name="l",
                        extra_keys=(("l", 3), None)),
            AllBlocksCleared("GPU"), AllBlocksCleared(), BlockRemoved((3,), "GPU", 2),
        )),
        LogRecord(2, "y", 1, 1, 2.5, ()),
        LogRecord(3, "z", 2, 7, 3.5, (BlockStored((2**64 - 1,), 0, (9,), 1, "GPU"),)),
    ]



def _sample_records(seed: int, n: int) -> list[LogRecord]:
    """``n`` records of a simulated two-engine fleet, then the special ones."""
    sim = FleetSimulator(["a", "b"], seed=seed)
    return [
        LogRecord(i + 1, src, 1, seq, 1000.0 + i, tuple(ev))
        for i, (src, ev, seq) in enumerate(sim.records(n))
    ] + _special_records()

def test_transcoder_matches_the_codec_byte_for_byte() -> None:
    records = _sample_records(seed=10, n=300)
    for r in records:
        got = transcode_record(encode_record(r))
        assert got.payload == encode_batch(r.events, r.ts, source=r.source), r
        bare = transcode_record(encode_record(r), with_source=False)
        assert bare.payload == encode_batch(r.events, r.ts), r
        assert (got.offset, got.source, got.num_events) == (r.offset, r.source, len(r.events))
        legacy = batch_for(encode_record(r), "legacy")
        assert legacy is not None
        assert legacy.payload == encode_batch(r.events, r.ts, layout="legacy")


def test_values_outside_the_schema_are_published_in_the_map_layout() -> None:
    # The map path checks types only (the state's apply counts the violation); the legacy path
    # validates, so such a record takes no seq there.
    r = LogRecord(1, "e", 1, 1, 1.0, (
        BlockRemoved((1,), "DISK", 0),  # type: ignore[arg-type]
        BlockStored((1,), None, (1,), 1, "X", kv_cache_spec_kind="weird"),  # type: ignore[arg-type]
    ))
    got = batch_for(encode_record(r), "map")
    assert got is not None and got.num_events == 2
    assert got.payload == encode_batch(r.events, r.ts, source="e")
    assert batch_for(encode_record(r), "legacy") is None


def test_bridge_errors_share_one_root() -> None:
    with pytest.raises(BridgeConfigError) as info:
        BridgeConfig(namespace="a:b")
    assert isinstance(info.value, BridgeError) and isinstance(info.value, ValueError)
    with pytest.raises(SeqIndexError) as seq_info:
        SeqIndex().offset_of(0)
    assert isinstance(seq_info.value, BridgeError)
    assert issubclass(PeerGone, BridgeError)


def test_unreadable_records_take_no_seq() -> None:
    assert batch_for(b"\x01garbage", "map") is None
    assert batch_for(b"\x01garbage", "legacy") is None
    assert not takes_seq(None, None)
    empty = batch_for(encode_record(_special_records()[1]), "map")
    assert empty is not None and not takes_seq(empty, None)
    full = batch_for(encode_record(_special_records()[2]), "map")
    assert takes_seq(full, None) and takes_seq(full, "z") and not takes_seq(full, "x")


def test_tip_reader_reads_the_epoch_after_the_records_and_waits_before_checking(
    client: redis.Redis,
) -> None:
    """One round trip reads the records after the published one and then the epoch; a blocking
    read waits first and checks after, so a log that went back shows once the wait is over."""
    from bridge.tip import TipReader

    keys = LogKeys()
    writer = LogWriter(client)
    ev = [BlockStored((1,), None, (1,), 1, "GPU")]
    first = writer.append("e1", ev, source_seq=1)
    second = writer.append("e1", ev, source_seq=2)
    client.set(keys.epoch, "ep-1")
    tip = TipReader(LogReader(client, keys), 10, keys.epoch)
    read = tip.read(1, encode_record(first), block_ms=50)
    assert [o for o, _ in read.entries] == [2] and read.epoch_read and read.epoch == "ep-1"
    assert not read.rewound
    client.delete(keys.epoch)
    read = tip.read(2, encode_record(second), block_ms=20)
    assert read.entries == [] and read.epoch_read and read.epoch is None  # waited, then checked
    # The record published at 1 is not the log's any more (same epoch): rewound, after the wait.
    assert tip.read(1, b"other bytes", block_ms=20).rewound
    assert not TipReader(LogReader(client, keys), 10).read(1, encode_record(first), 0).epoch_read


def test_publish_decoded_is_batch_for_and_the_record_once() -> None:
    """The publisher decodes a record once for the batch and the state: the same batch, byte
    for byte, as batch_for, and the record with its token ids packed (the record as stored
    once unpacked, the same bytes once encoded); a record outside the schema's literals comes
    from its view."""
    from bridge.transcode import publish_decoded
    from events.packed import PackedStored, unpacked
    from events.records import decode_record

    records = _sample_records(seed=11, n=100)
    for r in records:
        batch, record = publish_decoded(encode_record(r), "map")
        assert batch == batch_for(encode_record(r), "map"), r
        assert record is not None and encode_record(record) == encode_record(r), r
        assert not any(type(e) is BlockStored for e in record.events), r
        events = tuple(unpacked(e) if type(e) is PackedStored else e for e in record.events)
        assert events == decode_record(encode_record(r)).events, r  # as stored (inner arrays: lists)
        assert publish_decoded(encode_record(r), "legacy") == (batch_for(encode_record(r), "legacy"), None)
    odd = LogRecord(1, "e", 1, 1, 1.0, (BlockRemoved((1,), "DISK", 0),))  # type: ignore[arg-type]
    batch, record = publish_decoded(encode_record(odd), "map")
    assert record is None and batch == batch_for(encode_record(odd), "map") and batch is not None
    assert publish_decoded(b"\x01garbage", "map") == (None, None)


def test_tip_reader_wakes_for_a_record_written_during_its_wait(client: redis.Redis) -> None:
    """The wait, the check and the epoch go as one pipeline: a record written while it waits
    ends the wait and comes back checked, long before the wait's limit."""
    import threading
    import time

    from bridge.tip import TipReader

    keys = LogKeys()
    writer = LogWriter(client)
    ev = [BlockStored((1,), None, (1,), 1, "GPU")]
    first = writer.append("e1", ev, source_seq=1)
    client.set(keys.epoch, "ep-1")
    later = threading.Timer(0.1, lambda: writer.append("e1", ev, source_seq=2))
    later.start()
    started = time.monotonic()
    read = TipReader(LogReader(client, keys), 10, keys.epoch).read(1, encode_record(first), 3000)
    later.join()
    assert [o for o, _ in read.entries] == [2] and read.epoch == "ep-1" and not read.rewound
    assert time.monotonic() - started < 2.0
