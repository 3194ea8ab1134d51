#!/usr/bin/env python3
"""A router's view of the fleet from kv-bridge, in ~80 lines and two packages (pyzmq, msgspec).

Copy it: it depends on nothing of kvoffload. It decodes vLLM's KV-event wire format with its own
msgspec schema (the map layout; see WIRE.md), follows the live stream, detects a seq gap and
fills it from the replay socket, and keeps "which block hash is where" per source and tier.

    python examples/zmq_subscriber.py --pub tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558
"""

from __future__ import annotations

import argparse
import collections
import time

import msgspec
import zmq


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None
    source: str | None = None  # kvoffload's extension: which engine (or offloadd)


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    source: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    medium: str | None = None
    source: str | None = None


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


decoder = msgspec.msgpack.Decoder(KVEventBatch)
where: dict[tuple[str, str], set[int]] = collections.defaultdict(set)  # (source, medium) -> hashes


def apply(batch: KVEventBatch) -> None:
    for ev in batch.events:
        key = (ev.source or "engine", ev.medium or "GPU")
        if isinstance(ev, BlockStored):
            where[key].update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            where[key].difference_update(ev.block_hashes)
        else:
            for k in [k for k in where if k[0] == key[0] and (ev.medium is None or k[1] == ev.medium)]:
                where[k].clear()


def replay(dealer: zmq.Socket, start: int) -> int:
    """Ask for every batch from ``start``; return the seq to continue from."""
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    while True:
        _, _topic, seq, payload = dealer.recv_multipart()
        if seq == b"\xff" * 8:
            return start
        apply(decoder.decode(payload))
        start = int.from_bytes(seq, "big") + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pub", default="tcp://127.0.0.1:5557")
    ap.add_argument("--replay", default="tcp://127.0.0.1:5558")
    ap.add_argument("--topic", default="kv-events")
    ap.add_argument("--seconds", type=float, default=0, help="stop after this long (0: never)")
    args = ap.parse_args()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    sub.connect(args.pub)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(args.replay)
    next_seq = replay(dealer, 0)  # catch up on the whole retained log first
    deadline = time.monotonic() + args.seconds if args.seconds else float("inf")
    while time.monotonic() < deadline:
        if not sub.poll(500):
            continue
        _topic, seq_b, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_b, "big")
        if seq < next_seq:
            continue  # already applied through replay
        if seq > next_seq:
            next_seq = replay(dealer, next_seq)  # a gap: fill it, then go on live
            if seq < next_seq:
                continue
        apply(decoder.decode(payload))
        next_seq = seq + 1
    for (source, medium), hashes in sorted(where.items()):
        print(f"{source:<20} {medium}  {len(hashes)} blocks")
    print(f"next seq {next_seq}")


if __name__ == "__main__":
    main()
