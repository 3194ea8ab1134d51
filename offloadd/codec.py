"""OffloadStore's wire <-> domain conversion, both ways, for the client and the servicer alike.

Per message: ``*_request`` builds a request from domain values (client side) and ``*_from_proto``
reads its repeated parts back (servicer side; scalar fields are read off the proto as they are);
``*_to_proto`` / ``*_from_proto`` convert each answer. Error kinds that a status code alone
cannot tell apart travel as trailing metadata (:func:`error_trailers` / :func:`error_kind`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import cbor2
from kvcache.v1 import events_pb2
from kvcache.v1 import offload_pb2 as pb

from events.codec_vllm import freeze_arrays
from events.schema import SchemaError, check_extra_keys
from offloadd.errors import InvalidArgument, NotRegistered, RequestError
from offloadd.messages import (
    BlockData,
    BlockToStore,
    CommitOutcome,
    EngineRegistration,
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

_KIND_TO_PB = {"full_attention": events_pb2.KV_CACHE_SPEC_KIND_FULL_ATTENTION,
               "sliding_window": events_pb2.KV_CACHE_SPEC_KIND_SLIDING_WINDOW}
# UNSPECIFIED reads as full attention: an older client that never set the field meant it.
_KIND_FROM_PB = {0: "full_attention", **{v: k for k, v in _KIND_TO_PB.items()}}

ERROR_KIND_KEY = "kvd-error"
"""Trailing-metadata key naming an error kind finer than its status code."""
NOT_REGISTERED = "not-registered"
"""Value of ``kvd-error`` on FAILED_PRECONDITION when the engine must register (again)."""

# -- errors -------------------------------------------------------------------------------


def error_trailers(exc: RequestError) -> tuple[tuple[str, str], ...]:
    """Trailing metadata marking ``exc``'s kind, if its status code alone does not say it."""
    return ((ERROR_KIND_KEY, NOT_REGISTERED),) if isinstance(exc, NotRegistered) else ()


def error_kind(trailers: Iterable[Any] | None) -> str | None:
    """The ``kvd-error`` marker among a failed call's trailing metadata (pairs of key and
    value, as grpc gives them), if any."""
    for key, value in trailers or ():
        if key == ERROR_KIND_KEY:
            return value.decode() if isinstance(value, bytes) else value
    return None


# -- RegisterEngine -----------------------------------------------------------------------


def register_request(
    engine_id: str, incarnation: int, model_namespace: str, groups: Sequence[GroupSpec]
) -> pb.RegisterEngineRequest:
    return pb.RegisterEngineRequest(
        engine_id=engine_id, incarnation=incarnation, model_namespace=model_namespace,
        groups=[pb.GroupLayout(
            group_idx=g.group_idx, kind=_KIND_TO_PB.get(g.kind, 0),  # type: ignore[arg-type]
            sliding_window=g.sliding_window, block_size=g.block_size, block_bytes=g.block_bytes,
            dtype=g.dtype, layout=g.layout,
        ) for g in groups],
    )


def groups_from_proto(req: pb.RegisterEngineRequest) -> list[GroupSpec]:
    groups = []
    for i, g in enumerate(req.groups):
        if g.kind not in _KIND_FROM_PB:
            raise InvalidArgument(f"groups[{i}].kind: unknown value {g.kind}")
        groups.append(GroupSpec(g.group_idx, _KIND_FROM_PB[g.kind], g.sliding_window,
                                g.block_size, g.block_bytes, g.dtype, g.layout))
    return groups


def registration_to_proto(
    infos: Sequence[GroupArenaInfo], hash_algo: str
) -> pb.RegisterEngineResponse:
    return pb.RegisterEngineResponse(
        groups=[pb.GroupArena(
            group_idx=a.group_idx, layout_id=a.layout_id, slot_bytes=a.slot_bytes,
            slots_per_chunk=a.slots_per_chunk, max_slots=a.max_slots,
            chunk_path_template=a.chunk_path_template,
        ) for a in infos],
        hash_algo=hash_algo,
    )


def registration_from_proto(resp: pb.RegisterEngineResponse) -> EngineRegistration:
    return EngineRegistration(resp.hash_algo, {
        a.group_idx: GroupArenaInfo(a.group_idx, a.layout_id, a.slot_bytes, a.slots_per_chunk,
                                    a.max_slots, a.chunk_path_template)
        for a in resp.groups
    })


# -- Lookup -------------------------------------------------------------------------------


def lookup_request(
    engine_id: str, queries: Sequence[GroupQuery], pin: bool, lease_ms: int
) -> pb.LookupRequest:
    return pb.LookupRequest(
        engine_id=engine_id, pin=pin, lease_ms=lease_ms,
        queries=[pb.GroupQuery(group_idx=q.group_idx, block_hashes=list(q.block_hashes),
                               prefix_only=q.prefix_only) for q in queries],
    )


def queries_from_proto(req: pb.LookupRequest) -> list[GroupQuery]:
    return [GroupQuery(q.group_idx, tuple(q.block_hashes), q.prefix_only) for q in req.queries]


def lookup_to_proto(out: LookupOutcome) -> pb.LookupResponse:
    return pb.LookupResponse(
        results=[pb.GroupResult(group_idx=r.group_idx, num_prefix=r.num_prefix, slots=r.slots,
                                generations=r.generations) for r in out.results],
        lease_id=out.lease_id, lease_expires_unix_ms=out.lease_expires_unix_ms,
    )


def lookup_from_proto(resp: pb.LookupResponse) -> LookupOutcome:
    return LookupOutcome(
        tuple(GroupHit(r.group_idx, r.num_prefix, tuple(r.slots), tuple(r.generations))
              for r in resp.results),
        resp.lease_id, resp.lease_expires_unix_ms,
    )


# -- Reserve ------------------------------------------------------------------------------


def reserve_request(
    engine_id: str, group_idx: int, blocks: Sequence[BlockToStore], lease_ms: int,
    lora_name: str | None,
) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        engine_id=engine_id, group_idx=group_idx, lease_ms=lease_ms, lora_name=lora_name or "",
        blocks=[pb.BlockToStore(
            block_hash=b.block_hash, parent_block_hash=b.parent_block_hash or b"",
            token_ids=list(b.token_ids), extra_keys=b.extra_keys,
        ) for b in blocks],
    )


def blocks_from_proto(req: pb.ReserveRequest) -> list[BlockToStore]:
    """The blocks to store; raise InvalidArgument for extra keys the log could not hold, so a
    bad block is refused here rather than failing the Commit (and its write group) later."""
    blocks = []
    for i, b in enumerate(req.blocks):
        decode_extra_keys(b.extra_keys, f"blocks[{i}].extra_keys")
        blocks.append(BlockToStore(b.block_hash, b.parent_block_hash or None, tuple(b.token_ids),
                                   b.extra_keys))
    return blocks


def decode_extra_keys(data: bytes, what: str) -> tuple[Any, ...] | None:
    """One block's extra keys (canonical CBOR, b"" for none) as an event carries them; raise
    InvalidArgument naming ``what`` unless they are CBOR the log can hold (check_extra_keys)."""
    if not data:
        return None
    try:
        value = cbor2.loads(data)
    except Exception as exc:  # cbor2 raises several types on garbage
        raise InvalidArgument(f"{what}: not valid CBOR: {exc}") from exc
    try:
        check_extra_keys(value, what)
    except SchemaError as exc:
        raise InvalidArgument(str(exc)) from exc
    return None if value is None else freeze_arrays(value)  # type: ignore[no-any-return]


def reserve_to_proto(out: ReserveOutcome) -> pb.ReserveResponse:
    return pb.ReserveResponse(
        reservation_id=out.reservation_id,
        blocks=[pb.Reservation(status=int(s), slot=slot, generation=gen)  # type: ignore[arg-type]
                for (s, slot), gen in zip(out.blocks, out.generations, strict=True)],
        lease_expires_unix_ms=out.lease_expires_unix_ms,
    )


def reserve_from_proto(resp: pb.ReserveResponse) -> ReserveOutcome:
    return ReserveOutcome(
        resp.reservation_id,
        tuple((ReserveStatus(r.status), r.slot) for r in resp.blocks),
        resp.lease_expires_unix_ms,
        tuple(r.generation for r in resp.blocks),
    )


# -- Commit, Abort, Release -----------------------------------------------------------------


def commit_request(
    engine_id: str, reservation_id: str, block_hashes: Sequence[bytes]
) -> pb.CommitRequest:
    return pb.CommitRequest(engine_id=engine_id, reservation_id=reservation_id,
                            block_hashes=list(block_hashes))


def commit_to_proto(out: CommitOutcome) -> pb.CommitResponse:
    return pb.CommitResponse(num_committed=out.num_committed, log_offset=out.log_offset)


def commit_from_proto(resp: pb.CommitResponse) -> CommitOutcome:
    return CommitOutcome(resp.num_committed, resp.log_offset)


def abort_request(engine_id: str, reservation_id: str) -> pb.AbortRequest:
    return pb.AbortRequest(engine_id=engine_id, reservation_id=reservation_id)


def abort_to_proto(num_aborted: int) -> pb.AbortResponse:
    return pb.AbortResponse(num_aborted=num_aborted)


def abort_from_proto(resp: pb.AbortResponse) -> int:
    return int(resp.num_aborted)


def release_request(engine_id: str, lease_id: str) -> pb.ReleaseRequest:
    return pb.ReleaseRequest(engine_id=engine_id, lease_id=lease_id)


def release_to_proto(num_released: int) -> pb.ReleaseResponse:
    return pb.ReleaseResponse(num_released=num_released)


def release_from_proto(resp: pb.ReleaseResponse) -> int:
    return int(resp.num_released)


# -- Stats, ReadBlocks ----------------------------------------------------------------------


def stats_to_proto(s: StoreStats) -> pb.StatsResponse:
    return pb.StatsResponse(
        capacity_bytes=s.capacity_bytes, used_bytes=s.used_bytes, num_blocks=s.num_blocks,
        hits=s.hits, misses=s.misses, evictions=s.evictions, log_offset=s.log_offset,
        num_engines=s.num_engines,
        layouts=[pb.LayoutStats(
            layout_id=x.layout_id, slot_bytes=x.slot_bytes, num_slots=x.num_slots,
            num_ready=x.num_ready, num_reserved=x.num_reserved, num_pinned=x.num_pinned,
        ) for x in s.layouts],
    )


def stats_from_proto(resp: pb.StatsResponse) -> StoreStats:
    return StoreStats(
        resp.capacity_bytes, resp.used_bytes, resp.num_blocks, resp.hits, resp.misses,
        resp.evictions, resp.log_offset,
        tuple(LayoutStats(x.layout_id, x.slot_bytes, x.num_slots, x.num_ready, x.num_reserved,
                          x.num_pinned) for x in resp.layouts),
        resp.num_engines,
    )


def read_blocks_request(
    engine_id: str, group_idx: int, block_hashes: Sequence[bytes]
) -> pb.ReadBlocksRequest:
    return pb.ReadBlocksRequest(engine_id=engine_id, group_idx=group_idx,
                                block_hashes=list(block_hashes))


def block_data_to_proto(b: BlockData) -> pb.BlockData:
    return pb.BlockData(block_hash=b.block_hash, data=b.data, checksum=b.checksum,
                        parent_block_hash=b.parent_block_hash or b"", token_ids=b.token_ids,
                        extra_keys=b.extra_keys, lora_name=b.lora_name)


def block_data_wire(b: BlockData) -> bytes:
    """``b`` as a serialized BlockData, its bytes copied once: the small fields through
    protobuf, then field 2 (``data``) appended by hand (fields may come in any order)."""
    meta = pb.BlockData(block_hash=b.block_hash, checksum=b.checksum,
                        parent_block_hash=b.parent_block_hash or b"", token_ids=b.token_ids,
                        extra_keys=b.extra_keys, lora_name=b.lora_name).SerializeToString()
    if not b.data:
        return meta
    n, head = len(b.data), bytearray(b"\x12")
    while n >= 0x80:
        head.append(n & 0x7F | 0x80)
        n >>= 7
    head.append(n)
    return b"".join((meta, head, b.data))


def block_data_from_proto(b: pb.BlockData) -> BlockData:
    return BlockData(b.block_hash, b.data, b.checksum, b.parent_block_hash or None,
                     tuple(b.token_ids), b.extra_keys,
                     b.lora_name if b.HasField("lora_name") else None)
