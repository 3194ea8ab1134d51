"""offloadd.codec: every OffloadStore message converts to proto and back unchanged."""

from __future__ import annotations

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
