"""A fill over a peer's block port, received straight into reserved slots (issue 21).

One request to the peer pins and sends a whole chain (offloadd.fleet.block_port). Its headers
come first: the blocks that chain on the request's own hashes are reserved locally, then their
bytes are received in large pieces into one buffer, hashed once there and ``pwrite``n into the
reserved slots (the daemon never maps arena files: DECISIONS 27), and Commit takes those
checksums instead of reading every slot back. A block whose bytes do not match the checksum its
header carried ends the prefix; a transfer cut short keeps the blocks that arrived whole and
matched; everything else reserved is released. Never a wrong block, never a slot left reserved.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from offloadd.errors import RequestError
from offloadd.fleet.block_reader import PeerStream, Sink
from offloadd.messages import BlockData, BlockToStore, ReserveStatus
from offloadd.tier.layouts import Layout
from offloadd.tier.store import HostStore
from offloadd.tier.writes import StoreWriter


@dataclass(frozen=True)
class PortFill:
    stored: int  # blocks committed
    rejected: int  # offered by the peer, refused: chain, checksum, or cut off
    read_ms: float  # request, headers and bytes
    store_ms: float  # Reserve and Commit


async def fill_from_stream(store: HostStore, writer: StoreWriter, engine_id: str, layout: Layout,
                           stream: PeerStream, wanted: Sequence[bytes], parent: bytes | None,
                           provenance: str) -> PortFill:
    """Store the leading blocks of ``stream`` that are ``wanted`` (chained on ``parent``)."""
    offered = len(stream.blocks)
    good = _chained(stream.blocks, wanted, parent)
    if not good:
        return PortFill(0, offered, 0.0, 0.0)
    t0 = time.perf_counter()
    group = layout.record.group_idx
    res = await writer.reserve(engine_id, group, [BlockToStore(b.block_hash, b.parent_block_hash,
                                                               b.token_ids, b.extra_keys)
                                                  for b in good], 0, good[0].lora_name)
    if not res.reservation_id:  # every one stored or being stored here already
        return PortFill(0, offered - len(good), 0.0, (time.perf_counter() - t0) * 1e3)
    committed = False
    try:
        reservation = store.reservation(engine_id, res.reservation_id)
        reservation.provenance = provenance
        slots = [slot if status is ReserveStatus.RESERVED else -1 for status, slot in res.blocks]
        # While a worker thread writes its slots, neither expiry nor a new incarnation of the
        # engine may free them (flagged as a commit is); the transfer stops at half the lease.
        deadline = time.monotonic() + store.lease_ms(0) / 2000
        t1 = time.perf_counter()
        reservation.committing = True
        try:
            sums = await asyncio.to_thread(stream.receive, len(good), _sink(layout, slots, deadline))
        finally:
            reservation.committing = False
        t2 = time.perf_counter()
        ok = 0
        while ok < len(sums) and sums[ok] == good[ok].checksum:
            ok += 1
        mine = {good[i].block_hash: sums[i] for i in range(ok) if slots[i] >= 0}
        if not mine:
            return PortFill(0, offered, (t2 - t1) * 1e3, (t1 - t0) * 1e3)
        out = await writer.commit(engine_id, res.reservation_id, list(mine), mine)
        committed = True
        return PortFill(out.num_committed, offered - ok, (t2 - t1) * 1e3,
                        (t1 - t0 + time.perf_counter() - t2) * 1e3)
    finally:
        if not committed and store.leases.get_reservation(res.reservation_id) is not None:
            with contextlib.suppress(RequestError):  # being committed (a write in doubt): it decides
                writer.abort(engine_id, res.reservation_id)


def _sink(layout: Layout, slots: list[int], deadline: float) -> Sink:
    """Write block ``i`` into its reserved slot (-1: stored here already, its bytes skipped)."""
    g = layout.geometry
    sized: set[int] = set()  # chunk files seen whole: a write never grows one an engine truncated

    def sink(i: int, view: memoryview) -> None:
        slot = slots[i]
        if slot < 0:
            return
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
