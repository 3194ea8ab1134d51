"""A fill over a peer's block port, received straight into reserved slots (issue 21).

One request to the peer pins and sends a whole chain (offloadd.fleet.block_port). Its headers
come first: the blocks that chain on the request's own hashes are reserved locally (one
reservation per COMMIT_BLOCKS), then their bytes are received by a thread that only reads the
socket into a ring of pieces, hashed once there and ``pwrite``n into the reserved slots (the
daemon never maps arena files: DECISIONS 27); each reservation is committed, with those
checksums instead of a read-back of every slot, while the next blocks arrive. A block whose bytes do not match the checksum its
header carried ends the prefix; a transfer cut short keeps the blocks that arrived whole and
matched; everything else reserved is released. Never a wrong block, never a slot left reserved.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from offloadd.errors import RequestError, ResourceExhausted
from offloadd.fleet.block_reader import PeerStream, Sink
from offloadd.messages import BlockData, BlockToStore, ReserveStatus
from offloadd.tier.layouts import Layout
from offloadd.tier.store import HostStore
from offloadd.tier.writes import StoreWriter

COMMIT_BLOCKS = 64  # blocks per reservation: one is committed while the next ones arrive


@dataclass(frozen=True)
class PortFill:
    stored: int  # blocks committed
    rejected: int  # offered by the peer, refused: chain, checksum, or cut off
    read_ms: float  # the bytes, and the commits made meanwhile
    store_ms: float  # Reserve (before the bytes)


async def fill_from_stream(store: HostStore, writer: StoreWriter, engine_id: str, layout: Layout,
                           stream: PeerStream, wanted: Sequence[bytes], parent: bytes | None,
                           provenance: str) -> PortFill:
    """Store the leading blocks of ``stream`` that are ``wanted`` (chained on ``parent``): one
    reservation per COMMIT_BLOCKS, each committed while the next ones arrive."""
    offered = len(stream.blocks)
    good = _chained(stream.blocks, wanted, parent)
    if not good:
        return PortFill(0, offered, 0.0, 0.0)
    t0 = time.perf_counter()
    spans: list[_Span] = []
    stop = threading.Event()  # the receiving thread stops at its next block
    receiving: asyncio.Future[list[int]] | None = None
    try:
        for lo in range(0, len(good), COMMIT_BLOCKS):
            try:
                spans.append(await _reserve(store, writer, engine_id, layout, good, lo, provenance))
            except ResourceExhausted:  # no room for more: fill the prefix reserved so far
                if not spans:
                    raise
                break
        count = spans[-1].hi
        slots = [slot for span in spans for slot in span.slots]
        if all(not span.reservation_id for span in spans):  # all stored here already
            return PortFill(0, offered - count, 0.0, (time.perf_counter() - t0) * 1e3)
        loop = asyncio.get_running_loop()
        arrived: asyncio.Queue[int] = asyncio.Queue()  # blocks received so far; -1: no more
        ends = {span.hi for span in spans}

        def progress(i: int, _checksum: int) -> None:  # on the receiving thread
            if i + 1 in ends:
                loop.call_soon_threadsafe(arrived.put_nowait, i + 1)

        async def receive() -> list[int]:
            try:
                return await asyncio.to_thread(
                    stream.receive, count, _sink(layout, slots, deadline, stop), progress)
            finally:
                arrived.put_nowait(-1)

        # The transfer stops at half the lease of the reservations (flagged meanwhile).
        deadline = time.monotonic() + store.lease_ms(0) / 2000
        t1 = time.perf_counter()
        receiving = asyncio.ensure_future(receive())
        stored = ok = received = 0
        for span in spans:
            while 0 <= received < span.hi:
                received = await arrived.get()
            intact = _intact(good, stream, span)
            ok += intact
            stored += await _commit(store, writer, engine_id, span, good, intact, stream)
            if intact < span.hi - span.lo:
                break  # the rest is released below, once the thread stopped writing
        tail = time.perf_counter()
        return PortFill(stored, offered - ok, (tail - t1) * 1e3, (t1 - t0) * 1e3)
    finally:
        stop.set()
        if receiving is not None:
            with contextlib.suppress(Exception):
                await receiving
        for span in spans:
            _release(store, writer, engine_id, span)


@dataclass
class _Span:
    reservation_id: str  # "" when every block of it is stored here already
    lo: int
    hi: int
    slots: list[int]  # -1: stored here already, its bytes skipped
    attempted: bool = False  # its Commit was called (it decides the reservation's fate)


async def _reserve(store: HostStore, writer: StoreWriter, engine_id: str, layout: Layout,
                   good: list[BlockData], lo: int, provenance: str) -> _Span:
    part = good[lo:lo + COMMIT_BLOCKS]
    res = await writer.reserve(engine_id, layout.record.group_idx,
                               [BlockToStore(b.block_hash, b.parent_block_hash, b.token_ids, b.extra_keys)
                                for b in part], 0, part[0].lora_name)
    if res.reservation_id:
        reservation = store.reservation(engine_id, res.reservation_id)
        reservation.provenance = provenance
        # A worker thread writes its slots: neither expiry nor a new incarnation of the engine
        # may free them meanwhile (flagged as a commit is)
        reservation.committing = True
    return _Span(res.reservation_id, lo, lo + len(part),
                 [slot if status is ReserveStatus.RESERVED else -1 for status, slot in res.blocks])


def _intact(good: list[BlockData], stream: PeerStream, span: _Span) -> int:
    """How many leading blocks of ``span`` arrived whole with their header's checksum."""
    got = stream.sums
    n = 0
    while span.lo + n < min(span.hi, len(got)) and got[span.lo + n] == good[span.lo + n].checksum:
        n += 1
    return n


async def _commit(store: HostStore, writer: StoreWriter, engine_id: str, span: _Span,
                  good: list[BlockData], intact: int, stream: PeerStream) -> int:
    if not span.reservation_id:
        return 0
    mine = {good[span.lo + i].block_hash: stream.sums[span.lo + i]
            for i in range(intact) if span.slots[i] >= 0}
    res = store.leases.get_reservation(span.reservation_id)
    if not mine or res is None:
        return 0
    res.committing = False
    span.attempted = True
    out = await writer.commit(engine_id, span.reservation_id, list(mine), mine)
    return out.num_committed


def _release(store: HostStore, writer: StoreWriter, engine_id: str, span: _Span) -> None:
    """Free a span not committed (the receiving thread has stopped); one whose Commit was
    called is left to it (a write in doubt is resolved by the log)."""
    res = store.leases.get_reservation(span.reservation_id) if span.reservation_id else None
    if res is not None and not (span.attempted and res.committing):
        res.committing = False
        with contextlib.suppress(RequestError):
            writer.abort(engine_id, span.reservation_id)


def _sink(layout: Layout, slots: list[int], deadline: float, stop: threading.Event) -> Sink:
    """Write block ``i`` into its reserved slot (-1: stored here already, its bytes skipped)."""
    g = layout.geometry
    sized: set[int] = set()  # chunk files seen whole: a write never grows one an engine truncated

    def sink(i: int, view: memoryview) -> None:
        slot = slots[i]
        if slot < 0:
            return
        if stop.is_set():
            raise ValueError("stopped: a block before failed its checksum or its commit")
        if time.monotonic() > deadline:
            raise ValueError("the transfer outlasted half its reservation")
        fd, offset = layout.arena.file_of(slot)
        chunk = g.chunk_of(slot)
        if chunk not in sized:
            if os.fstat(fd).st_size < g.chunk_file_bytes:
                raise ValueError(f"arena chunk {chunk} was truncated")
            sized.add(chunk)
        if os.pwrite(fd, view, offset) != len(view):
            raise ValueError(f"short write into slot {slot}")

    return sink


def _chained(blocks: Sequence[BlockData], wanted: Sequence[bytes], parent: bytes | None) -> list[BlockData]:
    """The leading headers that are the ``wanted`` blocks, chained on ``parent`` and on each
    other (their bytes are checked as they arrive)."""
    good: list[BlockData] = []
    for b, want in zip(blocks, wanted, strict=False):
        if b.block_hash != want or b.parent_block_hash != parent:
            break
        good.append(b)
        parent = b.block_hash
    return good
