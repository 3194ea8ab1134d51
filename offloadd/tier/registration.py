"""RegisterEngine: KV layouts per group -> shared layout ids and arena geometry.

Engines registering the same layout identity share its layout id and its blocks. Redis first
(layouts and the engine's registration, so a restart maps the same files and knows the engine),
then memory.
"""

from __future__ import annotations

import asyncio

import msgspec

from offloadd.errors import InvalidArgument
from offloadd.log.projection import EngineRecord, LayoutRecord
from offloadd.messages import GroupArenaInfo, GroupSpec
from offloadd.tier.layouts import Layout
from offloadd.tier.store import HostStore

SPEC_KINDS = ("full_attention", "sliding_window")


class Registrar:
    """Serializes registrations: two engines bringing one new layout must get one id."""

    def __init__(self, store: HostStore) -> None:
        self.store = store
        self._lock = asyncio.Lock()

    async def register(
        self, engine_id: str, incarnation: int, model_namespace: str, groups: list[GroupSpec]
    ) -> list[GroupArenaInfo]:
        if not engine_id:
            raise InvalidArgument("engine_id must not be empty")
        if not model_namespace:
            raise InvalidArgument("model_namespace must not be empty")
        if not groups:
            raise InvalidArgument("groups must not be empty")
        async with self._lock:
            return await _register(self.store, engine_id, incarnation, model_namespace, groups)


async def _register(
    store: HostStore, engine_id: str, incarnation: int, model_namespace: str,
    groups: list[GroupSpec],
) -> list[GroupArenaInfo]:
    seen: set[int] = set()
    records: list[LayoutRecord] = []
    next_id = store.next_layout_id()
    for i, g in enumerate(groups):
        _check_group(i, g, seen)
        rec = LayoutRecord(
            0, model_namespace, g.group_idx, g.kind, g.sliding_window, g.block_size,
            g.block_bytes, g.dtype, g.layout, 0,
        )
        known = store.layout_with(rec.identity)
        if known is not None:
            records.append(known.record)
            continue
        try:
            geometry = store.geometry_for(next_id, rec.block_bytes)
        except ValueError as exc:
            raise InvalidArgument(f"groups[{i}]: {exc}") from exc
        rec = msgspec.structs.replace(
            rec, layout_id=next_id, slots_per_chunk=geometry.slots_per_chunk
        )
        next_id += 1
        records.append(rec)
    engine = EngineRecord(
        engine_id, incarnation, model_namespace,
        tuple((g.group_idx, r.layout_id) for g, r in zip(groups, records, strict=True)),
    )
    await store.metadata.write_registration(records, engine)
    layouts = [store.add_layout(rec) for rec in records]  # Redis first, then memory
    store.add_engine(engine)
    return [arena_info(g.group_idx, layout) for g, layout in zip(groups, layouts, strict=True)]


def arena_info(group_idx: int, layout: Layout) -> GroupArenaInfo:
    g = layout.geometry
    return GroupArenaInfo(
        group_idx, layout.layout_id, g.slot_bytes, g.slots_per_chunk, g.max_slots,
        g.chunk_path_template,
    )


def _check_group(i: int, g: GroupSpec, seen: set[int]) -> None:
    if g.group_idx in seen:
        raise InvalidArgument(f"groups[{i}]: duplicate group_idx {g.group_idx}")
    seen.add(g.group_idx)
    if g.kind not in SPEC_KINDS:
        raise InvalidArgument(f"groups[{i}]: kind must be one of {SPEC_KINDS}, got {g.kind!r}")
    if g.kind == "sliding_window" and g.sliding_window <= 0:
        raise InvalidArgument(f"groups[{i}]: a sliding_window group needs sliding_window > 0")
    if g.block_size <= 0:
        raise InvalidArgument(f"groups[{i}]: block_size must be > 0")
    if g.block_bytes <= 0:
        raise InvalidArgument(f"groups[{i}]: block_bytes must be > 0")

