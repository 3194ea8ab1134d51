"""Request builders and response parsers shared by the sync and async OffloadStore clients."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcache.v1 import offload_pb2

from offloadd.arena import ArenaGeometry, ArenaMapping, SlotGenerations, generations_path
from offloadd.messages import (
    BlockToStore,
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

_KIND_TO_PB = {"full_attention": 1, "sliding_window": 2}


@dataclass(frozen=True)
class EngineRegistration:
    hash_algo: str
    groups: dict[int, GroupArenaInfo]

    def map_arena(self, group_idx: int) -> ArenaMapping:
        """Map this group's arena files in this process (lazily, chunk by chunk)."""
        g = self.groups[group_idx]
        return ArenaMapping(
            ArenaGeometry(g.slot_bytes, g.slots_per_chunk, g.max_slots, g.chunk_path_template)
        )

    def map_generations(self, group_idx: int) -> SlotGenerations:
        """Map this group's generation table read-only: per slot, the generation of the block
        it serves now (0: none). FileNotFoundError from a daemon that publishes none."""
        g = self.groups[group_idx]
        return SlotGenerations(generations_path(g.chunk_path_template), g.max_slots)


@dataclass(frozen=True)
class CommitOutcome:
    num_committed: int
    log_offset: int


@dataclass(frozen=True)
class BlockData:
    block_hash: bytes
    data: bytes
    checksum: int


def register_request(
    engine_id: str, incarnation: int, model_namespace: str, groups: Sequence[GroupSpec]
) -> offload_pb2.RegisterEngineRequest:
    return offload_pb2.RegisterEngineRequest(
        engine_id=engine_id, incarnation=incarnation, model_namespace=model_namespace,
        groups=[offload_pb2.GroupLayout(
            group_idx=g.group_idx, kind=_KIND_TO_PB.get(g.kind, 0),  # type: ignore[arg-type]
            sliding_window=g.sliding_window, block_size=g.block_size, block_bytes=g.block_bytes,
            dtype=g.dtype, layout=g.layout,
        ) for g in groups],
    )


def registration_from(resp: offload_pb2.RegisterEngineResponse) -> EngineRegistration:
    return EngineRegistration(resp.hash_algo, {
        a.group_idx: GroupArenaInfo(a.group_idx, a.layout_id, a.slot_bytes, a.slots_per_chunk,
                                    a.max_slots, a.chunk_path_template)
        for a in resp.groups
    })


def lookup_request(
    engine_id: str, queries: Sequence[GroupQuery], pin: bool, lease_ms: int
) -> offload_pb2.LookupRequest:
    return offload_pb2.LookupRequest(
        engine_id=engine_id, pin=pin, lease_ms=lease_ms,
        queries=[offload_pb2.GroupQuery(group_idx=q.group_idx, block_hashes=list(q.block_hashes),
                                        prefix_only=q.prefix_only) for q in queries],
    )


def lookup_from(resp: offload_pb2.LookupResponse) -> LookupOutcome:
    return LookupOutcome(
        tuple(GroupHit(r.group_idx, r.num_prefix, tuple(r.slots), tuple(r.generations))
              for r in resp.results),
        resp.lease_id, resp.lease_expires_unix_ms,
    )


def reserve_request(
    engine_id: str, group_idx: int, blocks: Sequence[BlockToStore], lease_ms: int,
    lora_name: str | None,
) -> offload_pb2.ReserveRequest:
    return offload_pb2.ReserveRequest(
        engine_id=engine_id, group_idx=group_idx, lease_ms=lease_ms, lora_name=lora_name or "",
        blocks=[offload_pb2.BlockToStore(
            block_hash=b.block_hash, parent_block_hash=b.parent_block_hash or b"",
            token_ids=list(b.token_ids), extra_keys=b.extra_keys,
        ) for b in blocks],
    )


def reserve_from(resp: offload_pb2.ReserveResponse) -> ReserveOutcome:
    return ReserveOutcome(
        resp.reservation_id,
        tuple((ReserveStatus(r.status), r.slot) for r in resp.blocks),
        resp.lease_expires_unix_ms,
        tuple(r.generation for r in resp.blocks),
    )


def stats_from(resp: offload_pb2.StatsResponse) -> StoreStats:
    return StoreStats(
        resp.capacity_bytes, resp.used_bytes, resp.num_blocks, resp.hits, resp.misses,
        resp.evictions, resp.log_offset,
        tuple(LayoutStats(x.layout_id, x.slot_bytes, x.num_slots, x.num_ready, x.num_reserved,
                          x.num_pinned) for x in resp.layouts),
        resp.num_engines,
    )
