"""The daemon fills its CPU tier from a peer's on an engine's Lookup miss (issue 21 part 2).

Before answering an engine's Lookup, :meth:`FleetFill.fill` finds, per prefix-only group query,
the blocks past the local ready prefix, asks the fleet index (offloadd.fleet.index, kept from
the peers' logs by :meth:`FleetFill.refresh_forever`) which peer holds the longest run of them,
reads them from that peer's daemon (registered there as ``fleet:<this node>:<layout id>`` with
the layout's own spec: another layout holds none of them; Lookup pins them, ReadBlocks streams
bytes, checksums and each block's identity, Release), and stores what checks out as any store:
Reserve, the arena write, Commit, so the local log gets ``BlockStored(CPU)`` with
``provenance="fleet:<peer>"`` and the Lookup that follows answers it as a local hit.

A block is taken only when its bytes match their checksum and slot size and it chains on the
request's own hashes (its parent is the block before it); the first that does not ends the
prefix. Over gRPC, nothing is reserved before every byte arrived; over a peer's block port
(offloadd.fleet.port_fill) the slots are reserved first and the bytes received straight into
them, and what did not arrive whole and intact is released. Either way a peer that fails or
dies mid-transfer costs this Lookup (part of) its remote prefix (a recompute, or the next
Lookup retries), never a wrong block. Fills run one at a time (a Lookup whose next block no
peer holds does not wait for them), so a second engine missing the same prefix waits and then
finds it local.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from events.hashing import to_wire
from offloadd.client.errors import NotRegistered, OffloadClientError
from offloadd.client.offload_client import OffloadClient
from offloadd.errors import RequestError
from offloadd.fleet.block_reader import PeerStream
from offloadd.fleet.index import FleetIndex
from offloadd.fleet.peers import Peer
from offloadd.fleet.port_fill import fill_from_stream
from offloadd.log.metadata import RedisUnavailable
from offloadd.messages import BlockData, BlockToStore, GroupQuery, GroupSpec, ReserveStatus
from offloadd.tier.layouts import Layout
from offloadd.tier.store import EngineInfo, HostStore
from offloadd.tier.writes import StoreWriter

log = logging.getLogger(__name__)

STREAM_BLOCKS = 32  # blocks per ReadBlocks stream; a longer prefix is read over several at once
MAX_STREAMS = 4
READER_PREFIX = "fleet:"  # engine ids of peers' daemons reading this one: never filled in turn


@dataclass
class FillStats:
    num_fills: int = 0  # fills that stored at least one block
    num_blocks: int = 0  # blocks stored from peers
    num_failed: int = 0  # peer reads that failed (network, refused)
    num_rejected: int = 0  # blocks refused: checksum, size or chain


@dataclass(frozen=True)
class PeerLink:
    peer: Peer
    client: OffloadClient
    token: str | None = None  # for the peer's block port (the client sends it over gRPC)
    timeout_s: float = 2.0


class FleetFill:
    def __init__(self, store: HostStore, writer: StoreWriter, index: FleetIndex,
                 links: Sequence[PeerLink], node_name: str) -> None:
        self.store = store
        self.writer = writer
        self.index = index
        self.links = {link.peer.name: link for link in links}
        self.node_name = node_name
        self.stats = FillStats()
        self._lock = asyncio.Lock()
        self._registered: set[tuple[str, str]] = set()  # (peer, reader id)

    async def refresh_forever(self, interval_s: float) -> None:
        """Keep the fleet index up with the peers' logs (a Redis read per peer per round, off
        the Lookup path)."""
        failing = False
        while True:
            try:
                await asyncio.to_thread(self.index.refresh)
                failing = False
            except Exception as exc:  # Redis down or failing over: the index waits, stale
                if not failing:
                    log.warning("fleet index not refreshed: %s", exc)
                failing = True
            await asyncio.sleep(interval_s)

    def close(self) -> None:
        for link in self.links.values():
            link.client.close()

    async def fill(self, engine_id: str, queries: Sequence[GroupQuery]) -> int:
        """Store in the local tier what peers hold past each query's local prefix; how many
        blocks. Never raises for a peer's or a request's fault: the Lookup answers as it is."""
        if engine_id.startswith(READER_PREFIX) or not self.links:
            return 0
        engine = self.store.engines.get(engine_id)
        if engine is None:
            return 0  # the Lookup itself says NotRegistered
        total = 0
        for q in queries:
            if q.prefix_only and q.block_hashes:
                try:
                    if self._missing_held(engine, q):  # else no lock: misses nobody holds pass
                        async with self._lock:
                            total += await self._fill_group(engine, q)
                except (RequestError, RedisUnavailable) as exc:
                    log.warning("fleet fill for %s skipped: %s", engine_id, exc)
        return total

    def _local_prefix(self, engine: EngineInfo, q: GroupQuery) -> int:
        return self.store.lookup(engine.engine_id, [q], False, 0).results[0].num_prefix

    def _missing_held(self, engine: EngineInfo, q: GroupQuery) -> bool:
        """Whether a peer holds the block after the local prefix (the index, no I/O)."""
        local = self._local_prefix(engine, q)
        return local < len(q.block_hashes) and bool(
            self.index.holders([to_wire(q.block_hashes[local])], q.group_idx))

    async def _fill_group(self, engine: EngineInfo, q: GroupQuery) -> int:
        layout = self.store.layout_of(engine, q.group_idx)
        local = self._local_prefix(engine, q)  # again: a fill just before may have stored it
        missing = q.block_hashes[local:]
        if not missing:
            return 0
        parent = q.block_hashes[local - 1] if local else None
        for name, held in self.index.holders([to_wire(d) for d in missing], q.group_idx):
            link = self.links.get(name)
            if link is None:
                continue
            try:
                if link.peer.block_port:
                    n = await self._fill_over_port(engine, layout, link, missing[:held], parent)
                else:
                    n = await self._fill_over_grpc(engine, layout, link, missing[:held], parent)
            except OffloadClientError as exc:
                self.stats.num_failed += 1
                log.warning("fleet read from %s failed: %s", name, exc)
                continue
            if n:
                return n
        return 0

    async def _fill_over_port(self, engine: EngineInfo, layout: Layout, link: PeerLink,
                              hashes: Sequence[bytes], parent: bytes | None) -> int:
        """One block-port request pins and sends the chain; its bytes go straight into
        reserved slots (offloadd.fleet.port_fill)."""
        rec = layout.record
        for attempt in (1, 2):
            reader = await asyncio.to_thread(self._register, link, layout)
            t0 = time.perf_counter()
            try:
                stream = await asyncio.to_thread(
                    PeerStream.open, link.peer.block_address, link.token, link.timeout_s, reader,
                    rec.group_idx, hashes, layout.geometry.slot_bytes)
                break
            except OffloadClientError as exc:
                if attempt == 2 or "is not registered" not in exc.message:
                    raise
                self._registered.discard((link.peer.name, reader))  # the peer restarted
        with stream:
            out = await fill_from_stream(self.store, self.writer, engine.engine_id, layout, stream,
                                         hashes, parent, f"fleet:{link.peer.name}")
        self.stats.num_rejected += out.rejected
        if stream.error:
            self.stats.num_failed += 1
            log.warning("fleet read from %s cut short: %s", link.peer.name, stream.error)
        if out.stored:
            self.stats.num_fills += 1
            self.stats.num_blocks += out.stored
            log.info("fleet fill: %d blocks from %s for %s (%.1f ms: receive %.1f ms, store %.1f ms)",
                     out.stored, link.peer.name, engine.engine_id, (time.perf_counter() - t0) * 1e3,
                     out.read_ms, out.store_ms)
        return out.stored

    async def _fill_over_grpc(self, engine: EngineInfo, layout: Layout, link: PeerLink,
                              hashes: Sequence[bytes], parent: bytes | None) -> int:
        t0 = time.perf_counter()
        data = await asyncio.to_thread(self._read, link, layout, hashes)
        good = _chained(data, hashes, parent, layout.geometry.slot_bytes)
        self.stats.num_rejected += len(hashes) - len(good)
        if not good:
            return 0
        t1 = time.perf_counter()
        n = await self._store(engine.engine_id, layout, good, link.peer.name)
        log.info("fleet fill: %d blocks from %s for %s (read %.1f ms, store %.1f ms)", n,
                 link.peer.name, engine.engine_id, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3)
        return n

    def _register(self, link: PeerLink, layout: Layout) -> str:
        """This node's reader id on the peer for ``layout``, registered there (once) with the
        layout's own spec: a peer with another layout holds nothing under it."""
        rec = layout.record
        reader = f"{READER_PREFIX}{self.node_name}:{rec.layout_id}"
        key = (link.peer.name, reader)
        if key not in self._registered:
            spec = GroupSpec(rec.group_idx, rec.kind, rec.sliding_window, rec.block_size,
                             rec.block_bytes, rec.dtype, rec.layout)
            link.client.register_engine(reader, 1, rec.model_namespace, [spec])
            self._registered.add(key)
        return reader

    def _read(self, link: PeerLink, layout: Layout, hashes: Sequence[bytes]) -> list[BlockData]:
        """On a worker thread: pin, stream and release ``hashes`` on the peer (its longest
        ready prefix of them) over gRPC."""
        rec = layout.record
        query = [GroupQuery(rec.group_idx, tuple(hashes), prefix_only=True)]
        client = link.client
        for attempt in (1, 2):
            reader = self._register(link, layout)
            try:
                found = client.lookup(reader, query, pin=True)
                break
            except NotRegistered:  # the peer restarted: register again, once
                self._registered.discard((link.peer.name, reader))
                if attempt == 2:
                    raise
        held = found.results[0].num_prefix
        try:
            parts = [hashes[i:i + STREAM_BLOCKS] for i in range(0, held, STREAM_BLOCKS)]
            if len(parts) <= 1:
                return client.read_blocks(reader, rec.group_idx, hashes[:held]) if held else []
            with ThreadPoolExecutor(min(len(parts), MAX_STREAMS)) as pool:  # streams side by side
                got = pool.map(lambda p: client.read_blocks(reader, rec.group_idx, p), parts)
                return [b for part in got for b in part]
        finally:
            if found.lease_id:
                client.release(reader, found.lease_id)

    async def _store(self, engine_id: str, layout: Layout, good: list[BlockData], peer: str) -> int:
        blocks = [BlockToStore(b.block_hash, b.parent_block_hash, b.token_ids, b.extra_keys)
                  for b in good]
        res = await self.writer.reserve(engine_id, layout.record.group_idx, blocks, 0,
                                        good[0].lora_name)
        if not res.reservation_id:
            return 0
        self.store.reservation(engine_id, res.reservation_id).provenance = f"fleet:{peer}"
        written = {b.block_hash: b.checksum for (status, slot), b in zip(res.blocks, good, strict=True)
                   if status is ReserveStatus.RESERVED and layout.arena.write(slot, b.data)}
        if not written:
            self.writer.abort(engine_id, res.reservation_id)
            return 0
        # their checksums were verified on these bytes (_chained): no read back
        out = await self.writer.commit(engine_id, res.reservation_id, list(written), written)
        self.stats.num_fills += 1
        self.stats.num_blocks += out.num_committed
        return out.num_committed


def _chained(data: Sequence[BlockData], wanted: Sequence[bytes], parent: bytes | None,
             slot_bytes: int) -> list[BlockData]:
    """The leading blocks of ``data`` that are the ``wanted`` ones, intact, chained on
    ``parent`` and on each other."""
    good: list[BlockData] = []
    for b, want in zip(data, wanted, strict=False):
        if (b.block_hash != want or b.parent_block_hash != parent
                or len(b.data) != slot_bytes or xxhash.xxh3_64_intdigest(b.data) != b.checksum):
            break
        good.append(b)
        parent = b.block_hash
    return good
