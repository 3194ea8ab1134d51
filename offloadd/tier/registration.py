"""RegisterEngine: KV layouts per group -> shared layout ids and arena geometry.

Engines registering the same layout identity share its layout id and its blocks. A live
engine's registration is immutable: the same (engine_id, incarnation) again must be the same
registration (answered as before) and is refused otherwise; a higher incarnation (a restart)
registers anew and drops what the old one held; a lower one is refused. A layout name
(:func:`layout_name`) keeps the geometry it was first registered with. Every limit (block size,
number of layouts and engines, slot tables within the capacity) is checked before anything is
allocated. Redis first (layouts and the engine's registration, so a restart maps the same files
and knows the engine), then memory.
"""

from __future__ import annotations

import asyncio

import msgspec

from offloadd.config import OffloaddConfig
from offloadd.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from offloadd.log.projection import EngineRecord, LayoutRecord
from offloadd.messages import GroupArenaInfo, GroupSpec
from offloadd.tier.layouts import Layout, layout_name, table_bytes
from offloadd.tier.store import EngineInfo, HostStore

SPEC_KINDS = ("full_attention", "sliding_window")
GEOMETRY_FIELDS = ("kind", "sliding_window", "block_size", "block_bytes", "dtype", "layout")


class Registrar:
    """Serializes registrations: two engines bringing one new layout must get one id."""

    def __init__(self, store: HostStore) -> None:
        self.store = store
        self._lock = asyncio.Lock()

    async def register(
        self, engine_id: str, incarnation: int, model_namespace: str, groups: list[GroupSpec]
    ) -> list[GroupArenaInfo]:
        cfg = self.store.config
        _check_text("engine_id", engine_id, cfg)
        _check_text("model_namespace", model_namespace, cfg)
        if incarnation <= 0:
            raise InvalidArgument("incarnation must be > 0")
        if not groups:
            raise InvalidArgument("groups must not be empty")
        seen: set[int] = set()
        for i, g in enumerate(groups):
            _check_group(i, g, seen, cfg)
        records = [_record(model_namespace, g) for g in groups]
        async with self._lock:
            return await _register(self.store, engine_id, incarnation, model_namespace, records)


async def _register(
    store: HostStore, engine_id: str, incarnation: int, model_namespace: str,
    records: list[LayoutRecord],
) -> list[GroupArenaInfo]:
    known = store.engines.get(engine_id)
    if known is not None:
        if incarnation < known.incarnation:
            raise FailedPrecondition(
                f"engine {engine_id!r}: incarnation {incarnation} is older than the registered "
                f"incarnation {known.incarnation}"
            )
        if incarnation == known.incarnation:
            _check_same(store, known, model_namespace, records)
            return [arena_info(r.group_idx, store.layout(known.groups[r.group_idx])) for r in records]
    elif len(store.engines) >= store.config.max_engines:
        raise ResourceExhausted(f"{len(store.engines)} engines are registered, the limit")
    records = _resolve_layouts(store, records)
    engine = EngineRecord(
        engine_id, incarnation, model_namespace, tuple((r.group_idx, r.layout_id) for r in records)
    )
    await store.metadata.write_registration(records, engine)
    layouts = [store.add_layout(rec) for rec in records]  # Redis first, then memory
    if known is not None:
        store.drop_engine_claims(engine_id)  # the old incarnation's pins and reservations
    store.add_engine(engine)
    return [arena_info(r.group_idx, layout) for r, layout in zip(records, layouts, strict=True)]


def _resolve_layouts(store: HostStore, records: list[LayoutRecord]) -> list[LayoutRecord]:
    """Known layouts as they are, new ones with ids and geometry; refuses a name reused with
    another geometry and new layouts past the limits, all before anything is allocated."""
    out: list[LayoutRecord] = []
    next_id = store.next_layout_id()
    num_new = new_table_bytes = 0
    for i, rec in enumerate(records):
        known = store.layout_with(rec.identity)
        if known is not None:
            out.append(known.record)
            continue
        named = store.layout_named(layout_name(rec))
        if named is not None:
            raise FailedPrecondition(
                f"groups[{i}]: layout {rec.layout!r} of group {rec.group_idx} is registered with "
                f"another geometry: {_differences(rec, named.record)}"
            )
        try:
            geometry = store.geometry_for(next_id, rec.block_bytes)
        except ValueError as exc:
            raise InvalidArgument(f"groups[{i}]: {exc}") from exc
        num_new += 1
        new_table_bytes += table_bytes(geometry)
        out.append(msgspec.structs.replace(
            rec, layout_id=next_id, slots_per_chunk=geometry.slots_per_chunk
        ))
        next_id += 1
    _check_room(store, num_new, new_table_bytes)
    return out


def _check_room(store: HostStore, num_new: int, new_table_bytes: int) -> None:
    table = store.layouts
    if num_new and len(table.by_id) + num_new > store.config.max_layouts:
        raise ResourceExhausted(
            f"{num_new} new layouts would exceed the limit of {store.config.max_layouts} "
            f"({len(table.by_id)} registered)"
        )
    if num_new and table.table_bytes + new_table_bytes > table.table_budget_bytes:
        raise ResourceExhausted(
            f"the new layouts' slot tables ({new_table_bytes} bytes) do not fit the "
            f"{table.table_budget_bytes} bytes of slot tables the capacity allows "
            f"({table.table_bytes} used); register larger blocks"
        )


def _check_same(
    store: HostStore, known: EngineInfo, model_namespace: str, records: list[LayoutRecord]
) -> None:
    """The same incarnation registering again must bring the same registration."""
    where = f"engine {known.engine_id!r} incarnation {known.incarnation} is registered"
    if model_namespace != known.model_namespace:
        raise FailedPrecondition(
            f"{where} with model_namespace {known.model_namespace!r}, not {model_namespace!r}; "
            "a new registration needs a new incarnation"
        )
    wanted = sorted(r.group_idx for r in records)
    if wanted != sorted(known.groups):
        raise FailedPrecondition(
            f"{where} with groups {sorted(known.groups)}, not {wanted}; "
            "a new registration needs a new incarnation"
        )
    for rec in records:
        registered = store.layout(known.groups[rec.group_idx]).record
        if rec.identity != registered.identity:
            raise FailedPrecondition(
                f"{where} with another layout for group {rec.group_idx}: "
                f"{_differences(rec, registered)}; a new registration needs a new incarnation"
            )


def _differences(asked: LayoutRecord, registered: LayoutRecord) -> str:
    return ", ".join(
        f"{name} {getattr(asked, name)!r} (registered: {getattr(registered, name)!r})"
        for name in GEOMETRY_FIELDS if getattr(asked, name) != getattr(registered, name)
    )


def _record(model_namespace: str, g: GroupSpec) -> LayoutRecord:
    return LayoutRecord(
        0, model_namespace, g.group_idx, g.kind, g.sliding_window, g.block_size,
        g.block_bytes, g.dtype, g.layout, 0,
    )


def arena_info(group_idx: int, layout: Layout) -> GroupArenaInfo:
    g = layout.geometry
    return GroupArenaInfo(
        group_idx, layout.layout_id, g.slot_bytes, g.slots_per_chunk, g.max_slots,
        g.chunk_path_template,
    )


def _check_text(what: str, text: str, cfg: OffloaddConfig) -> None:
    if not text:
        raise InvalidArgument(f"{what} must not be empty")
    if len(text.encode()) > cfg.max_id_bytes:
        raise InvalidArgument(f"{what} is longer than {cfg.max_id_bytes} bytes")


def _check_group(i: int, g: GroupSpec, seen: set[int], cfg: OffloaddConfig) -> None:
    if g.group_idx in seen:
        raise InvalidArgument(f"groups[{i}]: duplicate group_idx {g.group_idx}")
    seen.add(g.group_idx)
    if g.kind not in SPEC_KINDS:
        raise InvalidArgument(f"groups[{i}]: kind must be one of {SPEC_KINDS}, got {g.kind!r}")
    if g.kind == "sliding_window" and g.sliding_window <= 0:
        raise InvalidArgument(f"groups[{i}]: a sliding_window group needs sliding_window > 0")
    if g.block_size <= 0:
        raise InvalidArgument(f"groups[{i}]: block_size must be > 0")
    if g.block_bytes < cfg.min_block_bytes:
        raise InvalidArgument(
            f"groups[{i}]: block_bytes {g.block_bytes} is below the minimum of "
            f"{cfg.min_block_bytes} (min_block_bytes)"
        )
    for what, text in (("dtype", g.dtype), ("layout", g.layout)):
        if len(text.encode()) > cfg.max_id_bytes:
            raise InvalidArgument(f"groups[{i}]: {what} is longer than {cfg.max_id_bytes} bytes")
