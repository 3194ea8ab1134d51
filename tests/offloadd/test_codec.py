"""offloadd.codec: every OffloadStore message converts to proto and back unchanged."""

from __future__ import annotations

import re

import cbor2
import pytest

from offloadd import codec
from offloadd.errors import FailedPrecondition, InvalidArgument, NotRegistered
from offloadd.messages import (
    BlockData,
    BlockToStore,
    CommitOutcome,
    GroupArenaInfo,
    GroupHit,
    GroupQuery,
    GroupSpec,
    LayoutStats,
    LookupOutcome,
    ReserveOutcome,
    ReserveStatus,
    StoreStats,
)

H = b"\x01" * 32


def test_requests_round_trip() -> None:
    groups = [GroupSpec(0, "full_attention", 0, 16, 4096, "bfloat16", "L"),
              GroupSpec(1, "sliding_window", 128, 16, 2048, "bfloat16", "L")]
    assert codec.groups_from_proto(codec.register_request("e", 3, "m", groups)) == groups
    queries = [GroupQuery(0, (H, H), prefix_only=False), GroupQuery(1, ())]
    assert codec.queries_from_proto(codec.lookup_request("e", queries, True, 5)) == queries
    blocks = [BlockToStore(H, None, (1, 2), b""), BlockToStore(H, H, (3, 4), b"\x80")]
    assert codec.blocks_from_proto(codec.reserve_request("e", 0, blocks, 0, None)) == blocks


def test_answers_round_trip() -> None:
    infos = [GroupArenaInfo(0, 7, 4096, 8, 64, "/dev/shm/x-{chunk}")]
    reg = codec.registration_from_proto(codec.registration_to_proto(infos, "sha256_cbor"))
    assert (reg.hash_algo, list(reg.groups.values())) == ("sha256_cbor", infos)
    found = LookupOutcome((GroupHit(0, 1, (4, -1), (9, 0)),), "lease", 123)
    assert codec.lookup_from_proto(codec.lookup_to_proto(found)) == found
    reserved = ReserveOutcome("r", ((ReserveStatus.RESERVED, 2), (ReserveStatus.ALREADY_STORED, -1)),
                              99, (5, 0))
    assert codec.reserve_from_proto(codec.reserve_to_proto(reserved)) == reserved
    assert codec.commit_from_proto(codec.commit_to_proto(CommitOutcome(2, 10))) == CommitOutcome(2, 10)
    assert codec.abort_from_proto(codec.abort_to_proto(3)) == 3
    assert codec.release_from_proto(codec.release_to_proto(4)) == 4
    stats = StoreStats(1 << 20, 4096, 1, 2, 3, 4, 5, (LayoutStats(7, 4096, 64, 1, 0, 0),), 1)
    assert codec.stats_from_proto(codec.stats_to_proto(stats)) == stats
    data = BlockData(H, b"kv", 42)
    assert codec.block_data_from_proto(codec.block_data_to_proto(data)) == data


def test_unknown_kind_is_invalid_argument() -> None:
    req = codec.register_request("e", 1, "m", [GroupSpec(0, "full_attention", 0, 16, 64, "f", "l")])
    req.groups[0].kind = 7  # type: ignore[assignment]
    with pytest.raises(InvalidArgument, match=r"groups\[0\].kind: unknown value 7"):
        codec.groups_from_proto(req)


def test_only_not_registered_is_marked() -> None:
    trailers = codec.error_trailers(NotRegistered("engine 'x' is not registered"))
    assert codec.error_kind(trailers) == codec.NOT_REGISTERED
    assert codec.error_kind([(codec.ERROR_KIND_KEY, codec.NOT_REGISTERED.encode())]) == codec.NOT_REGISTERED
    assert codec.error_trailers(FailedPrecondition("lease 'l' is unknown or expired")) == ()
    assert codec.error_kind(None) is None


def test_extra_keys_the_log_cannot_hold_are_invalid_arguments() -> None:
    """Reserve's blocks are refused at the edge, naming the value's path, unless their extra
    keys are CBOR that the log's msgpack holds and a frozen event carries."""
    ok = cbor2.dumps(["mm", b"\x00", -(2**63), 2**64 - 1, 1.5, None, True, [1, [2]]])
    assert codec.decode_extra_keys(ok, "k") == ("mm", b"\x00", -(2**63), 2**64 - 1, 1.5, None,
                                                True, (1, (2,)))
    assert codec.decode_extra_keys(b"", "k") is None
    assert codec.decode_extra_keys(cbor2.dumps(None), "k") is None
    deep: list[object] = [1]
    for _ in range(8):
        deep = [deep]
    refused = {
        cbor2.dumps([1, [2, cbor2.CBORTag(1234, 5)]]): "k[1][1]: CBOR tag 1234",
        cbor2.dumps([2**64]): "k[0]: integer",
        cbor2.dumps([-(2**63) - 1]): "k[0]: integer",
        b"\x81\xf7": "k[0]: CBOR undefined",
        b"\x81\xf0": "k[0]: CBOR simple value 16",
        cbor2.dumps([{"a": 1}]): "k[0]: a map",
        cbor2.dumps(deep): "nested deeper than 8",
        cbor2.dumps(list(range(2000))): "more than 1024 values",
        cbor2.dumps(["x" * 70_000]): "characters and bytes",
        cbor2.dumps("text"): "k: must be an array or null",
    }
    for data, fragment in refused.items():
        with pytest.raises(InvalidArgument, match=re.escape(fragment)):
            codec.decode_extra_keys(data, "k")
    tagged = cbor2.dumps([cbor2.CBORTag(7, 1)])
    bad = codec.reserve_request("e", 0, [BlockToStore(H, None, (1,), tagged)], 0, None)
    with pytest.raises(InvalidArgument, match=r"blocks\[0\]\.extra_keys\[0\]: CBOR tag 7"):
        codec.blocks_from_proto(bad)
