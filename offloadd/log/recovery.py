"""Warm restart: rebuild the daemon's state from Redis and the arena files it left behind.

1. Load the newest usable checkpoint into the one reducer (CacheState) and replay the log after
   it; with no checkpoint, the whole log (offloadd.log.checkpoint): fencing positions and every
   tier. Recovery time follows resident state plus the tail, not the log's history.
2. Arena identity: a marker file in arena_dir must match the id stored in Redis. If it does, the
   daemon keeps its incarnation and seq; if not (first start, or /dev/shm was wiped), it starts a
   new incarnation, deletes stale chunk files, logs ``AllBlocksCleared(CPU)`` and forgets the
   engine registrations (engines re-register and map the new files).
3. Log epoch (``LogKeys.epoch``): the log's identity. Kept when the log is there; a fresh log
   gets a new random one (SET NX), and so does a log that is gone although the head key said it
   had records (Redis lost it): engines, the bridge and kvctl see the change and re-sync.
4. Layouts and engines come back from the projection; chunk files are mapped again.
5. Blocks: the projection (slot, checksum...) is checked against the reducer's CPU tier; blocks
   that disagree are not served and their removal is logged. Every restored block's bytes are
   then checked against its xxh3 checksum: in the background once serving has started, and on
   demand by the first Lookup/ReadBlocks that would return it, so a corrupt block is never
   served (it is dropped and its removal logged instead).
"""

from __future__ import annotations

import asyncio
import gc
import glob
import logging
import os
import time
import uuid
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from operator import attrgetter, itemgetter

import msgspec
from redis.exceptions import RedisError

from events.schema import AllBlocksCleared, BlockRemoved, Event
from offloadd.log.checkpoint_load import restore
from offloadd.log.metadata import Append, Persisted, RedisUnavailable
from offloadd.log.projection import Pipe
from offloadd.tier.index import SlotEntry
from offloadd.tier.source import DAEMON_SOURCE
from offloadd.tier.store import HostStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryReport:
    log_offset: int
    num_records: int
    num_blocks: int
    num_dropped: int
    arena_reused: bool
    daemon_incarnation: int
    seconds: float
    load_and_replay_seconds: float
    log_epoch: str = ""
    checkpoint_offset: int = 0  # the checkpoint loaded (0: none, the whole log was replayed)


def arena_id_path(arena_dir: str, namespace: str) -> str:
    return os.path.join(arena_dir, f"kvd-{namespace}.arena-id")


async def recover(store: HostStore) -> RecoveryReport:
    # Recovery allocates a few objects per block; with the cyclic GC on, every young
    # collection would rescan a heap of millions. Off while rebuilding, then the rebuilt state
    # is frozen into the permanent generation so later collections skip it too.
    gc.disable()
    try:
        return await _recover(store)
    finally:
        gc.freeze()
        gc.enable()


async def _recover(store: HostStore) -> RecoveryReport:
    t0 = time.perf_counter()
    md, cfg = store.metadata, store.config
    meta = asyncio.ensure_future(md.load_meta())  # small reads, while the checkpoint loads
    try:
        base = await restore(md)
        persisted = await meta
    finally:
        meta.cancel()
    base_offset = base.offset if base is not None else 0
    # Redis is one more core, and serves one command at a time: the tail's first pages are
    # asked for, then the projection's rows (~0.7 us a row of Redis' time), which Redis makes
    # while the tail is replayed here (yielding between pages, so their replies are taken in).
    tail = md.iter_log(start=base_offset + 1)  # its first pages are asked for now
    rows = asyncio.ensure_future(md.load_rows(persisted))
    num_records = 0
    try:
        async for records in tail:
            for record in records:
                md.state.apply(record)
            num_records += len(records)
            await asyncio.sleep(0)
        persisted.blocks = await rows
    finally:
        rows.cancel()
    t_replay = time.perf_counter() - t0
    md.head = md.state.offset
    if persisted.head != md.head:
        log.error("head key says %d but the log ends at %d; trusting the log", persisted.head, md.head)
    for source, pos in persisted.sources.items():
        if md.state.fence(source) != pos:
            log.error("projection fence of %s is %s, log says %s", source, pos, md.state.fence(source))
    epoch = await _log_epoch(store, persisted)
    marker = arena_id_path(cfg.arena_dir, cfg.namespace)
    arena_id = persisted.daemon.get("arena_id")
    reused = arena_id is not None and _read(marker) == arena_id
    fence = md.state.fence(DAEMON_SOURCE)
    if reused:
        store.source.start(*(fence or (int(persisted.daemon["incarnation"]), 0)))
    else:
        await _new_arena(store, persisted, marker)
    for rec in persisted.layouts:
        store.add_layout(rec)
    for eng in persisted.engines:
        store.add_engine(eng)
    dropped = await _restore_blocks(store, persisted) if reused else 0
    report = RecoveryReport(
        md.head, num_records, sum(lay.index.num_ready for lay in store.all_layouts()),
        dropped, reused, store.source.incarnation, time.perf_counter() - t0, t_replay, epoch,
        base_offset,
    )
    log.info("recovered %s", report)
    return report


async def _log_epoch(store: HostStore, persisted: Persisted) -> str:
    """The log's epoch: the stored one, or a new one for a fresh or lost log."""
    md = store.metadata
    key = md.keys.epoch
    try:
        raw = await md.client.get(key)
        lost = md.head == 0 and persisted.head > 0
        if raw is not None and not lost:
            return str(raw.decode() if isinstance(raw, bytes) else raw)
        new = uuid.uuid4().hex
        if lost:  # the records are gone but an epoch is left: it names a log that no longer is
            log.error("the log is gone (head key said %d): starting log epoch %s", persisted.head, new)
            await md.set_epoch(new, only_if_absent=False)
        else:
            new = await md.set_epoch(new, only_if_absent=True)
            if md.head > 0:
                log.warning("log without an epoch (written before epochs): its epoch is now %s", new)
            elif persisted.daemon:
                log.error("the log is gone (Redis lost it): starting log epoch %s", new)
            else:
                log.info("new log: epoch %s", new)
        return new
    except (RedisError, OSError) as exc:
        raise RedisUnavailable(f"Redis unreachable during recovery: {exc}") from exc


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _zero(path: str) -> None:
    try:
        with open(path, "r+b") as f:
            f.write(bytes(os.fstat(f.fileno()).st_size))
    except OSError as exc:
        log.warning("could not clear old generation table %s: %s", path, exc)


async def _new_arena(store: HostStore, persisted: Persisted, marker: str) -> None:
    md, cfg = store.metadata, store.config
    fence = md.state.fence(DAEMON_SOURCE)
    old = fence[0] if fence else int(persisted.daemon.get("incarnation", "0"))
    store.source.start(old + 1, 0)
    for path in glob.glob(os.path.join(cfg.arena_dir, f"kvd-{cfg.namespace}-L*-C*")):
        if path.endswith("-Cgen"):  # an engine may still map it: nothing it names is servable
            _zero(path)
        os.unlink(path)
    persisted.layouts = [msgspec.structs.replace(r, num_chunks=0) for r in persisted.layouts]
    # Engines that mapped the old files must re-register and map the new ones: a stale mapping
    # would copy KV bytes into an unlinked file while the daemon serves the new one.
    persisted.engines = []
    await md.client.delete(md.keys.engines)
    had_blocks = any(s == DAEMON_SOURCE for s, _, _ in md.state.counts())
    keys = [md.keys.blocks(r.layout_id) for r in persisted.layouts]
    await md.write_registration(persisted.layouts, None)
    if had_blocks:
        await md.append(Append(
            DAEMON_SOURCE, store.source.incarnation, 1, (AllBlocksCleared("CPU"),),
            project=lambda pipe: pipe.delete(*keys) if keys else None, apply=store.source.logged,
        ))
    elif keys:
        await md.client.delete(*keys)
    new_id = uuid.uuid4().hex
    os.makedirs(cfg.arena_dir, exist_ok=True)
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, cfg.file_mode)
    with os.fdopen(fd, "w") as f:
        f.write(new_id)
    await md.set_daemon_fields({"arena_id": new_id, "incarnation": str(store.source.incarnation)})
    log.warning("arena not found or not ours: new daemon incarnation %d", store.source.incarnation)


async def _restore_blocks(store: HostStore, persisted: Persisted) -> int:
    """Insert the restorable blocks (unverified); log the removal of any the log announced but
    the projection cannot place."""
    state = store.metadata.state
    announced: dict[int, AbstractSet[int]] = {}  # group -> wire hashes the reducer says are resident
    for src, medium, group in state.counts():
        if src == DAEMON_SOURCE and medium == "CPU":
            announced[group] = state.resident(DAEMON_SOURCE, "CPU", group)  # a view, not a copy
    served: dict[int, set[int]] = {}
    bad: dict[int, list[bytes]] = {}  # layout -> digests in the projection to delete
    for layout in store.all_layouts():
        group = layout.record.group_idx
        rows = persisted.blocks.get(layout.layout_id, {})
        restored, wires, refused = _slot_entries(
            rows, announced.get(group, frozenset()), layout.index.num_slots, store.source.next_generations)
        if group in served:
            served[group] |= wires
        else:
            served[group] = wires
        if refused:
            bad[layout.layout_id] = refused
        store.restore(layout, restored)
    events: list[Event] = []
    for group, hashes in sorted(announced.items()):
        have = served.get(group, set())  # a subset of hashes (_slot_entries): equal when as long
        if len(have) < len(hashes):
            events.append(BlockRemoved(tuple(sorted(hashes - have)), "CPU", group))
    dropped = sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
    if events or bad:
        await _log_drops(store, events, bad)
    if dropped:
        log.error("dropped %d blocks that failed verification", dropped)
    return dropped


def _slot_entries(
    rows: dict[bytes, SlotEntry], expected: AbstractSet[int], num_slots: int,
    next_generations: Callable[[int], range],
) -> tuple[dict[bytes, SlotEntry], set[int], list[bytes]]:
    """The entries to restore from one layout's projection rows (decoded as entries, READY and
    unverified: bytes are checked after serving starts, Integrity.verify_restored, and before
    any Lookup or ReadBlocks returns the block), each given its generation, their wire hashes,
    and the rows refused: a block the log does not hold, a slot out of range, a slot an earlier
    row already claims. Checked for all rows at once, each step a C loop (map, set); only a
    layout with a refused row is walked row by row."""
    wires = set(map(int.from_bytes, map(_WIRE_BYTES, rows)))  # events.hashing.to_wire
    slots = list(map(_SLOT, rows.values()))
    is_clean = (not slots or (min(slots) >= 0 and max(slots) < num_slots)) and (
        len(set(slots)) == len(slots) and len(wires) == len(rows) and expected >= wires)
    if not is_clean:  # rare (a crash between the log and the projection): row by row
        return _slot_entries_checked(rows, expected, num_slots, next_generations)
    for entry, generation in zip(rows.values(), next_generations(len(rows)), strict=True):
        entry.generation = generation
    return rows, wires, []


_WIRE_BYTES = itemgetter(slice(-8, None))  # a wire hash is a digest's last 8 bytes, big-endian
_SLOT = attrgetter("slot")


def _slot_entries_checked(
    rows: dict[bytes, SlotEntry], expected: AbstractSet[int], num_slots: int,
    next_generations: Callable[[int], range],
) -> tuple[dict[bytes, SlotEntry], set[int], list[bytes]]:
    """:func:`_slot_entries`, one row at a time."""
    entries: dict[bytes, SlotEntry] = {}
    wires: set[int] = set()
    refused: list[bytes] = []
    used: set[int] = set()
    for digest, entry in rows.items():
        wire = int.from_bytes(digest[-8:], "big")
        slot = entry.slot
        if wire not in expected or slot in used or not 0 <= slot < num_slots:
            refused.append(digest)
            continue
        entry.generation = next_generations(1)[0]
        entries[digest] = entry
        wires.add(wire)
        used.add(slot)
    return entries, wires, refused


async def _log_drops(store: HostStore, events: list[Event], bad: dict[int, list[bytes]]) -> None:
    md = store.metadata
    keys = {md.keys.blocks(layout_id): digests for layout_id, digests in bad.items()}

    def project(pipe: Pipe) -> None:
        for key, digests in keys.items():
            pipe.hdel(key, *digests)

    if not events:  # projection rows the log never announced: nothing to tell readers
        for key, digests in keys.items():
            await md.client.hdel(key, *digests)
        return
    await md.append(Append(
        DAEMON_SOURCE, store.source.incarnation, store.source.next_seq(), tuple(events), project,
        store.source.logged,
    ))
