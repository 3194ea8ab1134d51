"""Registered KV layouts: each one's arena files, slot index and share of the capacity.

Engines that register the same layout (same model namespace, group, kind, window, block size,
block bytes, dtype and layout string) get the same ``layout_id`` and share its blocks. A layout's
name (model namespace, group and layout string) names one geometry: :func:`layout_name`. Chunk
files are created lazily, as slots are needed, while the total stays within ``capacity_bytes``;
slot tables (8 bytes a slot, made with the layout) stay within a quarter of it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import msgspec
import xxhash

from offloadd.arena import ArenaGeometry, chunk_path_template, create_chunk_file
from offloadd.config import OffloaddConfig
from offloadd.errors import FailedPrecondition
from offloadd.log.projection import LayoutRecord
from offloadd.slot_generations import GENERATION_BYTES, SlotGenerations, generations_path
from offloadd.tier.arena_files import ArenaFiles
from offloadd.tier.eviction import make_policy
from offloadd.tier.index import LayoutIndex

log = logging.getLogger(__name__)


class ArenaDamaged(FailedPrecondition):
    """A slot's bytes are gone: another process resized its chunk file."""


@dataclass
class Layout:
    record: LayoutRecord
    geometry: ArenaGeometry
    arena: ArenaFiles
    index: LayoutIndex
    generations: SlotGenerations

    @property
    def layout_id(self) -> int:
        return self.record.layout_id

    @property
    def num_chunks(self) -> int:
        return self.record.num_chunks

    def checksum(self, slot: int) -> int:
        """xxh3 of the slot's bytes; ArenaDamaged if its chunk file lost them."""
        view = None if self.index.is_lost(slot) else self.arena.read_view(slot)
        if view is None:
            raise ArenaDamaged(f"layout {self.layout_id} slot {slot}: its arena file was resized")
        return xxhash.xxh3_64_intdigest(view)

    def read(self, slot: int) -> bytes | None:
        """A copy of the slot's bytes; None if its chunk file is too short to hold them."""
        return self.arena.read(slot)


def layout_name(record: LayoutRecord) -> str:
    """What engines call a layout; two geometries under one name would be one name for two
    slot numberings. The offloaded block size is part of the name: engines of one model may
    offload blocks of different multiples of their engine block, each its own layout."""
    return msgspec.json.encode(
        [record.model_namespace, record.group_idx, record.layout, record.block_size]).decode()


def table_bytes(geometry: ArenaGeometry) -> int:
    """Bytes of the layout's slot generation table (made with the layout, whatever it holds)."""
    return geometry.max_slots * GENERATION_BYTES


class LayoutTable:
    def __init__(self, config: OffloaddConfig) -> None:
        self.config = config
        self.by_id: dict[int, Layout] = {}
        self.by_identity: dict[str, int] = {}
        self.by_name: dict[str, int] = {}
        self.allocated_bytes = 0
        self.table_bytes = 0

    @property
    def table_budget_bytes(self) -> int:
        """The slot tables of all layouts together stay within this part of the capacity."""
        return self.config.capacity_bytes // 4

    def geometry_for(self, layout_id: int, block_bytes: int, slots_per_chunk: int = 0) -> ArenaGeometry:
        """Equal chunks of at most ~chunk_bytes that together use the capacity (a recovered
        layout keeps the ``slots_per_chunk`` its files were made with)."""
        cfg = self.config
        if block_bytes > cfg.capacity_bytes:
            raise ValueError(
                f"block_bytes {block_bytes} exceeds the arena capacity {cfg.capacity_bytes}"
            )
        total = cfg.capacity_bytes // block_bytes
        per_chunk = slots_per_chunk or max(1, total // -(-cfg.capacity_bytes // cfg.chunk_bytes))
        per_chunk = min(per_chunk, total)
        return ArenaGeometry(
            slot_bytes=block_bytes,
            slots_per_chunk=per_chunk,
            max_slots=(total // per_chunk) * per_chunk,
            chunk_path_template=chunk_path_template(cfg.arena_dir, cfg.namespace, layout_id),
        )

    def next_id(self) -> int:
        return max(self.by_id, default=0) + 1

    def add(self, record: LayoutRecord) -> Layout:
        """Add a layout (new, or recovered with its chunk files) and map its chunks."""
        cfg = self.config
        geometry = self.geometry_for(record.layout_id, record.block_bytes, record.slots_per_chunk)
        record = msgspec.structs.replace(record, slots_per_chunk=geometry.slots_per_chunk)
        os.makedirs(cfg.arena_dir, exist_ok=True)
        # All zeros until blocks are committed or verified again (a warm restart's blocks are
        # unverified). With verify_on_load every load must ask, so nothing is published.
        generations = SlotGenerations.create(
            generations_path(geometry.chunk_path_template), geometry.max_slots, cfg.file_mode, cfg.file_gid,
        )
        layout = Layout(
            record=record,
            geometry=geometry,
            arena=ArenaFiles(geometry),
            index=LayoutIndex(make_policy(cfg.eviction), None if cfg.verify_on_load else generations),
            generations=generations,
        )
        self.by_id[record.layout_id] = layout
        self.by_identity[record.identity] = record.layout_id
        self.by_name[layout_name(record)] = record.layout_id
        self.table_bytes += table_bytes(geometry)
        for chunk in range(record.num_chunks):
            self._create_chunk(layout, chunk)
        layout.index.grow(record.num_chunks * geometry.slots_per_chunk)
        self.allocated_bytes += record.num_chunks * geometry.chunk_file_bytes
        return layout

    def can_grow(self, layout: Layout) -> bool:
        g = layout.geometry
        return (
            self.allocated_bytes + g.chunk_file_bytes <= self.config.capacity_bytes
            and (layout.num_chunks + 1) * g.slots_per_chunk <= g.max_slots
        )

    def grow(self, layout: Layout) -> None:
        """Create the layout's next chunk file; its slots become free."""
        g = layout.geometry
        self._create_chunk(layout, layout.num_chunks)
        layout.record = _with_chunks(layout.record, layout.num_chunks + 1)
        layout.index.grow(g.slots_per_chunk)
        self.allocated_bytes += g.chunk_file_bytes

    def _create_chunk(self, layout: Layout, chunk: int) -> None:
        os.makedirs(self.config.arena_dir, exist_ok=True)
        g = layout.geometry
        path = g.chunk_path(chunk)
        existed = os.path.exists(path)
        found = create_chunk_file(path, g.chunk_file_bytes, self.config.file_mode, self.config.file_gid)
        if existed and found != g.chunk_file_bytes:  # a warm restart's blocks past it fail their checksum
            log.warning("arena chunk %s had %d bytes, expected %d: resized to fit", path, found,
                        g.chunk_file_bytes)
        layout.arena.open_chunk(chunk)

    def close(self) -> None:
        for layout in self.by_id.values():
            layout.arena.close()
            layout.generations.close()


def _with_chunks(record: LayoutRecord, num_chunks: int) -> LayoutRecord:
    return msgspec.structs.replace(record, num_chunks=num_chunks)
