"""Domain messages of the OffloadStore API: what offloadd.codec converts protobuf to and from."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from offloadd.arena import ArenaGeometry, ArenaMapping
from offloadd.slot_generations import SlotGenerations, generations_path


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group of an engine, as registered."""

    group_idx: int
    kind: str  # "full_attention" | "sliding_window"
    sliding_window: int
    block_size: int
    block_bytes: int
    dtype: str
    layout: str


@dataclass(frozen=True)
class GroupArenaInfo:
    group_idx: int
    layout_id: int
    slot_bytes: int
    slots_per_chunk: int
    max_slots: int
    chunk_path_template: str


@dataclass(frozen=True)
class EngineRegistration:
    """RegisterEngine's answer: the hash scheme and, per group, where its arena lives."""

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
class GroupQuery:
    group_idx: int
    block_hashes: tuple[bytes, ...]
    prefix_only: bool = True


@dataclass(frozen=True)
class GroupHit:
    group_idx: int
    num_prefix: int
    slots: tuple[int, ...]  # one per hash looked at; -1 where not ready
    generations: tuple[int, ...] = ()  # per slot, its assignment (0 where -1; empty: not sent)


@dataclass(frozen=True)
class LookupOutcome:
    results: tuple[GroupHit, ...]
    lease_id: str
    lease_expires_unix_ms: int


@dataclass(frozen=True)
class BlockToStore:
    block_hash: bytes
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: bytes = b""  # canonical CBOR; b"" for none


class ReserveStatus(enum.IntEnum):
    """Values equal to kvcache.v1.Reservation.Status."""

    RESERVED = 1
    ALREADY_STORED = 2
    IN_FLIGHT = 3
    NO_SPACE = 4


@dataclass(frozen=True)
class ReserveOutcome:
    reservation_id: str  # empty when nothing was reserved
    blocks: tuple[tuple[ReserveStatus, int], ...]  # (status, slot or -1), in request order
    lease_expires_unix_ms: int
    generations: tuple[int, ...] = ()  # per block, the slot's assignment; 0 unless reserved


@dataclass(frozen=True)
class CommitOutcome:
    num_committed: int
    log_offset: int


@dataclass(frozen=True)
class BlockData:
    """One block's bytes as ReadBlocks returns them (the slow path; loads use the arena)."""

    block_hash: bytes
    data: bytes
    checksum: int
    # Its identity as stored (for a peer storing it in turn; empty where not sent):
    parent_block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    extra_keys: bytes = b""
    lora_name: str | None = None


@dataclass(frozen=True)
class LayoutStats:
    layout_id: int
    slot_bytes: int
    num_slots: int
    num_ready: int
    num_reserved: int
    num_pinned: int


@dataclass(frozen=True)
class StoreStats:
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    hits: int
    misses: int
    evictions: int
    log_offset: int
    layouts: tuple[LayoutStats, ...]
    num_engines: int
