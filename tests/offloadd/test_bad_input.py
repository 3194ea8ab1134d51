"""Every kind of bad input gets a clear status and message; the daemon keeps serving, intact."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
from kvcache.v1 import log_pb2_grpc

from offloadd.client import (
    BlockToStore,
    GroupQuery,
    GroupSpec,
    NotRegistered,
    OffloadClient,
    OffloadClientError,
)
from tests.offloadd.conftest import GROUP, SLOT, chain, digest
from tests.support.offloadd_proc import DaemonProcess

H = digest(0)


def expect(code: str, fragment: str, call: Callable[[], Any]) -> None:
    with pytest.raises(OffloadClientError) as err:
        call()
    assert err.value.code.name == code, err.value
    assert fragment in err.value.message, err.value.message


def test_bad_requests(daemon: DaemonProcess, client: OffloadClient) -> None:
    arena = client.register_engine("e", 1, "m", [GROUP]).map_arena(0)
    res = client.reserve("e", 0, chain(2))
    for _, slot in res.blocks:
        arena.write(slot, bytes(SLOT))
    client.commit("e", res.reservation_id)
    before = (client.stats(), client.snapshot())
    q = GroupQuery(0, (H,))
    cases: list[tuple[str, str, Callable[[], Any]]] = [
        # unregistered engines
        ("FAILED_PRECONDITION", "not registered", lambda: client.lookup("nobody", [q])),
        ("FAILED_PRECONDITION", "not registered",
         lambda: client.reserve("nobody", 0, chain(1))),
        # wrong hash sizes, named by index
        ("INVALID_ARGUMENT", "queries[0].block_hashes[1]: hash is 8 bytes, expected 32",
         lambda: client.lookup("e", [GroupQuery(0, (H, b"12345678"))])),
        ("INVALID_ARGUMENT", "blocks[0].block_hash: hash is 3 bytes",
         lambda: client.reserve("e", 0, [BlockToStore(b"abc", None, (1, 2, 3, 4))])),
        ("INVALID_ARGUMENT", "blocks[0].parent_block_hash: hash is 16 bytes",
         lambda: client.reserve("e", 0, [BlockToStore(H, b"x" * 16, (1, 2, 3, 4))])),
        # unknown groups (layouts)
        ("INVALID_ARGUMENT", "group_idx 3 is not registered",
         lambda: client.lookup("e", [GroupQuery(3, (H,))])),
        ("INVALID_ARGUMENT", "group_idx 1 is not registered",
         lambda: client.reserve("e", 1, chain(1))),
        ("INVALID_ARGUMENT", "token_ids: expected 4 ids",
         lambda: client.reserve("e", 0, [BlockToStore(digest(9), None, (1, 2))])),
        ("INVALID_ARGUMENT", "duplicate",
         lambda: client.reserve("e", 0, [chain(1, salt="d")[0]] * 2)),
        ("INVALID_ARGUMENT", "extra_keys: not valid CBOR",
         lambda: client.reserve("e", 0, [BlockToStore(digest(9), None, (1, 2, 3, 4), b"\xff\xff")])),
        ("INVALID_ARGUMENT", "extra_keys: must be an array or null",
         lambda: client.reserve("e", 0, [BlockToStore(digest(9), None, (1, 2, 3, 4), b"\x01")])),
        # oversize requests
        ("INVALID_ARGUMENT", "exceed the limit",
         lambda: client.lookup("e", [GroupQuery(0, (H,) * 20_000)])),
        # unknown / expired / foreign reservations and leases
        ("FAILED_PRECONDITION", "unknown or expired", lambda: client.commit("e", "nope")),
        ("FAILED_PRECONDITION", "unknown or expired", lambda: client.abort("e", "nope")),
        ("FAILED_PRECONDITION", "unknown or expired", lambda: client.release("e", "nope")),
        ("NOT_FOUND", "block_hashes[0] is not resident",
         lambda: client.read_blocks("e", 0, [digest(99)])),
        # bad registrations
        ("INVALID_ARGUMENT", "engine_id must not be empty",
         lambda: client.register_engine("", 1, "m", [GROUP])),
        ("INVALID_ARGUMENT", "groups must not be empty",
         lambda: client.register_engine("x", 1, "m", [])),
        ("INVALID_ARGUMENT", "exceeds the arena capacity",
         lambda: client.register_engine("x", 1, "m", [GroupSpec(0, "full_attention", 0, 4, 1 << 30, "f", "l")])),
        ("INVALID_ARGUMENT", "needs sliding_window > 0",
         lambda: client.register_engine("x", 1, "m", [GroupSpec(0, "sliding_window", 0, 4, 64, "f", "l")])),
        ("INVALID_ARGUMENT", "duplicate group_idx",
         lambda: client.register_engine("x", 1, "m", [GROUP, GROUP])),
    ]
    for code, fragment, call in cases:
        expect(code, fragment, call)
    own = client.reserve("e", 0, chain(1, salt="own"))
    client.register_engine("f", 1, "m", [GROUP])
    expect("FAILED_PRECONDITION", "belongs to another engine", lambda: client.commit("f", own.reservation_id))
    expect("INVALID_ARGUMENT", "not part of reservation",
           lambda: client.commit("e", own.reservation_id, [digest(1234)]))
    client.abort("e", own.reservation_id)
    after = (client.stats(), client.snapshot())
    assert after[1] == before[1]
    assert (after[0].num_blocks, after[0].log_offset) == (before[0].num_blocks, before[0].log_offset)
    assert client.lookup("e", [GroupQuery(0, tuple(b.block_hash for b in chain(2)))]).results[0].num_prefix == 2


def test_unregistered_engine_raises_not_registered(client: OffloadClient) -> None:
    """Engines tell "register again" apart by type (a trailer on the wire), not by message."""
    client.register_engine("e", 1, "m", [GROUP])
    q = GroupQuery(0, (H,))
    calls: list[Callable[[], Any]] = [
        lambda: client.lookup("nobody", [q]),
        lambda: client.lookup("nobody", [q], pin=True),
        lambda: client.lookup_future("nobody", [q]).result(timeout=5),
        lambda: client.reserve("nobody", 0, chain(1)),
        lambda: client.read_blocks("nobody", 0, [H]),
    ]
    for call in calls:
        with pytest.raises(NotRegistered) as err:
            call()
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "is not registered; call RegisterEngine" in err.value.message
    # Other refusals stay plain, even when their message says "not registered".
    for call in [lambda: client.lookup("e", [GroupQuery(3, (H,))]),
                 lambda: client.release("e", "nope")]:
        with pytest.raises(OffloadClientError) as other:
            call()
        assert not isinstance(other.value, NotRegistered)


def test_garbage_bytes(daemon: DaemonProcess, client: OffloadClient) -> None:
    garbage = b"\xff\xff\xff\xff\x0f"
    with grpc.insecure_channel(daemon.target) as ch:
        lookup = ch.unary_unary("/kvcache.v1.OffloadStore/Lookup")
        with pytest.raises(grpc.RpcError) as err:
            lookup(garbage, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid kvcache.v1.LookupRequest" in err.value.details()
        publish = ch.stream_stream("/kvcache.v1.EventIngest/Publish")
        with pytest.raises(grpc.RpcError) as err:
            list(publish(iter([garbage]), timeout=5))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        subscribe = ch.unary_stream("/kvcache.v1.EventLog/Subscribe")
        with pytest.raises(grpc.RpcError) as err:
            list(subscribe(garbage, timeout=5))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert log_pb2_grpc.EventLogStub(ch) is not None
    assert client.stats().num_blocks == 0  # still serving
