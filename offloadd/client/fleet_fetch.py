"""Fetch blocks another node's offloadd holds into this node's (issue 21 part 2).

The peer is read like any store, with the engine's own layout: :func:`fetch_prefix` registers
on the peer under ``fleet:<engine id>`` with the same group spec (a peer whose layout differs
refuses the registration or holds none of the blocks: a layout mismatch is a miss, never a
wrong block), pins the longest prefix the peer holds (Lookup: nothing is evicted under the
transfer), streams those blocks' bytes with their xxh3 checksums (ReadBlocks), releases the pin,
and stores what checks out in the local daemon as any engine does (Reserve, write the slots
through the arena, Commit: the local log gets ``BlockStored(CPU)``). A block whose bytes do not
match their checksum or slot size ends the prefix there. A peer that dies mid-transfer raises
before anything is reserved locally: the caller recomputes or retries. The blocks are then
loaded as local CPU-tier hits. Node-to-node calls carry the same TLS and token as engines'
(the :class:`OffloadClient` given).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from offloadd.arena import ArenaMapping
from offloadd.client.offload_client import OffloadClient
from offloadd.messages import BlockToStore, GroupQuery, GroupSpec


@dataclass(frozen=True)
class FetchOutcome:
    """``held``: the prefix the peer had; ``fetched``: committed locally now; ``present``:
    already stored locally; ``rejected``: bytes that failed their checksum or size."""

    held: int
    fetched: int
    present: int
    rejected: int


def fleet_engine_id(engine_id: str) -> str:
    return f"fleet:{engine_id}"


def fetch_prefix(local: OffloadClient, arena: ArenaMapping, engine_id: str, peer: OffloadClient,
                 model_namespace: str, group: GroupSpec, blocks: Sequence[BlockToStore]) -> FetchOutcome:
    """Copy the longest prefix of ``blocks`` (a chain, in order) the peer holds into the local
    daemon, under ``engine_id`` (registered locally, ``arena`` its mapping of ``group``)."""
    if not blocks:
        return FetchOutcome(0, 0, 0, 0)
    reader = fleet_engine_id(engine_id)
    peer.register_engine(reader, 1, model_namespace, [group])
    hashes = tuple(b.block_hash for b in blocks)
    found = peer.lookup(reader, [GroupQuery(group.group_idx, hashes, prefix_only=True)], pin=True)
    held = found.results[0].num_prefix
    try:
        data = peer.read_blocks(reader, group.group_idx, hashes[:held]) if held else []
    finally:
        if found.lease_id:
            peer.release(reader, found.lease_id)
    good = 0
    for blk, got in zip(blocks, data, strict=False):
        if (got.block_hash != blk.block_hash or len(got.data) != group.block_bytes
                or xxhash.xxh3_64_intdigest(got.data) != got.checksum):
            break
        good += 1
    rejected = held - good
    if not good:
        return FetchOutcome(held, 0, 0, rejected)
    res = local.reserve(engine_id, group.group_idx, blocks[:good])
    fetched = 0
    try:
        for (status, slot), got in zip(res.blocks, data, strict=False):
            if status.name == "RESERVED":
                arena.write(slot, got.data)
                fetched += 1
        if res.reservation_id:
            local.commit(engine_id, res.reservation_id)
    except BaseException:
        if res.reservation_id:
            local.abort(engine_id, res.reservation_id)
        raise
    return FetchOutcome(held, fetched, good - fetched, rejected)
