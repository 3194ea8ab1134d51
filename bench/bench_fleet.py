"""Cross-node transfer: a chain fetched from another node's offloadd vs bare transports.

    python bench/bench_fleet.py [--blocks 256] [--block-kib 256] [--repeats 5]
                                [--out bench/results/fleet_transfer.json]

Two real daemons on loopback (two nodes' namespaces on one Redis). Node A holds a chain of
``--blocks`` blocks of ``--block-kib`` KiB (stored as an engine stores). Measured, each
``--repeats`` times, on the same bytes in the same run:

- **fetch**: ``offloadd.client.fleet_fetch.fetch_prefix`` into node B: Lookup+pin on A, the
  ReadBlocks stream with xxh3 checksums (verified), Release, then Reserve, arena writes and
  Commit on B (its log gets the BlockStored). B's copy is dropped between repeats (a fresh
  namespace per repeat) so every repeat moves every block;
- **fill**: what an engine on node B sees (DECISIONS 44): B started with ``--fleet-peers``,
  an engine's Lookup of the chain misses locally and daemon B reads it from A and stores it
  before answering (timed: that one Lookup);
- **fill_block_port**: the same with A's ``--fleet-block-port`` (raw TCP, sendfile from the
  arena files; the peer named ``...@PORT``): one request pins and sends the chain, the bytes
  are received straight into B's reserved slots (offloadd.fleet.port_fill);
- **fill_block_port_warm**: the same on a full node whose arena pages were written before
  (it first filled another chain and evicts it): steady state, no first touch of tmpfs pages;
- **readblocks**: the ReadBlocks stream from A alone (what the network part costs);
- **block_port_read**: the same blocks read from A's block port alone;
- **bare gRPC**: a server streaming the same bytes in messages of one block each;
- **bare TCP**: one socket sending the same bytes, the reader receiving into one buffer (the
  baseline of every ratio);
- **bare TCP, other process**: the same with the sender in a child process (``sendfile``
  from a file), as the peer's daemon is: what the process boundary alone costs;
- **bare TLS**: the same bytes over TLS (Python's ssl), threads as in bare TCP: the most a
  block port under TLS could reach (DECISIONS 55).

Rates are MB/s of block bytes; ratios against bare TCP (the issue's goal: fetch >= 0.7x).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


from bench_fleet_baselines import bare_grpc, bare_tcp, bare_tcp_other_process, bare_tls

from offloadd.client import BlockToStore, GroupQuery, GroupSpec, OffloadClient
from offloadd.client.fleet_fetch import fetch_prefix
from offloadd.fleet.block_reader import read_blocks_raw
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_proc import RedisProcess, free_port
from tests.support.synthetic_engine import block_bytes, digest


def _fill(target: str, group: GroupSpec, n: int, name: str = "bench") -> list[BlockToStore]:
    chain = [BlockToStore(digest(name, i), digest(name, i - 1) if i else None, tuple(range(i, i + 16)))
             for i in range(n)]
    with OffloadClient(target, timeout_s=60) as c:
        arena = c.register_engine(f"filler-{name}", 1, "bench", [group]).map_arena(0)
        for at in range(0, n, 64):
            part = chain[at:at + 64]
            res = c.reserve(f"filler-{name}", 0, part)
            for blk, (_, slot) in zip(part, res.blocks, strict=True):
                arena.write(slot, block_bytes(blk.block_hash, group.block_bytes))
            c.commit(f"filler-{name}", res.reservation_id)
        arena.close()
    return chain


def _fill_lookup(work: Path, redis_url: str, namespace: str, peer: str, group: GroupSpec,
                 capacity: int, chain: list[BlockToStore], started: list[DaemonProcess],
                 warm: list[BlockToStore] | None = None) -> float:
    """Seconds of one engine Lookup on a fresh node that its daemon fills from node A. With
    ``warm``: the node holds just one chain and first filled ``warm`` from A, so the timed fill
    evicts it and reuses arena pages written before (a full node in steady state) instead of
    touching fresh tmpfs pages (which cost about as much as the transfer here)."""
    if warm is not None:
        capacity = len(chain) * group.block_bytes
    c = DaemonProcess(work, redis_url, namespace, capacity_bytes=capacity, extra_args=(
        "--log-level", "WARNING", "--max-request-hashes", "100000", "--fleet-peers",
        peer, "--fleet-timeout-s", "60", "--fleet-refresh-ms", "20"))
    c.start()
    started.append(c)
    query = [GroupQuery(0, tuple(b.block_hash for b in chain))]
    with OffloadClient(c.target, timeout_s=120) as local:
        local.register_engine("c-eng", 1, "bench", [group])
        time.sleep(1.0)  # c's fleet index has read a's log
        if warm is not None:
            first = local.lookup("c-eng", [GroupQuery(0, tuple(b.block_hash for b in warm))])
            assert first.results[0].num_prefix == len(warm), first
        t0 = time.perf_counter()
        hit = local.lookup("c-eng", query).results[0].num_prefix
        dt = time.perf_counter() - t0
    assert hit == len(chain), hit
    c.kill()
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/results/fleet_transfer.json")
    args = ap.parse_args()
    size = args.block_kib * 1024
    group = GroupSpec(0, "full_attention", 0, 16, size, "bfloat16", "bench-layout")
    capacity = args.blocks * size * 2
    times: dict[str, list[float]] = {"fetch": [], "fill": [], "fill_block_port": [],
                                     "fill_block_port_warm": [], "readblocks": [],
                                     "block_port_read": [],
                                     "bare_grpc": [], "bare_tcp": [], "bare_tcp_other_process": [],
                                     "bare_tls": []}
    block_port = free_port()
    # Arenas on tmpfs, as in production (/dev/shm): a disk-backed /tmp adds page-cache writeback.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="bench-fleet-", dir=shm) as tmp:
        work = Path(tmp)
        redis_proc = RedisProcess(work / "redis")
        redis_proc.start()
        a = DaemonProcess(work / "a", redis_proc.url, "node-a", capacity_bytes=capacity,
                          extra_args=("--log-level", "WARNING", "--max-request-hashes", "100000",
                                      "--fleet-block-port", str(block_port)))
        a.start()
        nodes_b: list[DaemonProcess] = []
        try:
            chain = _fill(a.target, group, args.blocks)
            warm = _fill(a.target, group, args.blocks, "warm")
            payloads = [block_bytes(b.block_hash, size) for b in chain]
            with OffloadClient(a.target, timeout_s=120) as peer:
                peer.register_engine("reader", 1, "bench", [group])
                for r in range(args.repeats):
                    t0 = time.perf_counter()
                    data = peer.read_blocks("reader", 0, [b.block_hash for b in chain])
                    times["readblocks"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    raw = read_blocks_raw(("127.0.0.1", block_port), None, 60, "reader", 0,
                                          [b.block_hash for b in chain], size)
                    times["block_port_read"].append(time.perf_counter() - t0)
                    assert [x.data for x in raw] == [x.data for x in data]
                    assert len(data) == args.blocks
                    b = DaemonProcess(work / f"b{r}", redis_proc.url, f"node-b{r}", capacity_bytes=capacity,
                                      extra_args=("--log-level", "WARNING"))
                    b.start()
                    nodes_b.append(b)
                    with OffloadClient(b.target, timeout_s=120) as local:
                        arena = local.register_engine("b-eng", 1, "bench", [group]).map_arena(0)
                        t0 = time.perf_counter()
                        out = fetch_prefix(local, arena, "b-eng", peer, "bench", group, chain)
                        times["fetch"].append(time.perf_counter() - t0)
                        arena.close()
                    assert out.fetched == args.blocks, out
                    b.kill()
                    times["fill"].append(_fill_lookup(work / f"c{r}", redis_proc.url, f"node-c{r}",
                                                      f"a={a.target}/node-a", group, capacity, chain, nodes_b))
                    times["fill_block_port"].append(_fill_lookup(
                        work / f"d{r}", redis_proc.url, f"node-d{r}", f"a={a.target}/node-a@{block_port}",
                        group, capacity, chain, nodes_b))
                    times["fill_block_port_warm"].append(_fill_lookup(
                        work / f"w{r}", redis_proc.url, f"node-w{r}", f"a={a.target}/node-a@{block_port}",
                        group, capacity, chain, nodes_b, warm))
                    times["bare_grpc"].append(bare_grpc(payloads))
                    times["bare_tcp"].append(bare_tcp(payloads))
                    times["bare_tcp_other_process"].append(bare_tcp_other_process(payloads, work))
                    times["bare_tls"].append(bare_tls(payloads, work))
        finally:
            for b in nodes_b:
                b.kill()
            a.kill()
            redis_proc.stop()
    total_mb = args.blocks * size / 1e6
    rates = {k: total_mb / statistics.median(v) for k, v in times.items()}
    for k, v in rates.items():
        print(f"{k:20s} {v:8.0f} MB/s  ({v / rates['bare_tcp']:.3f}x bare TCP, "
              f"{v / rates['bare_grpc']:.3f}x bare gRPC)")
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"host": platform.node(), "args": vars(args), "bytes": args.blocks * size,
                                    "seconds": times, "median_mb_per_s": rates,
                                    "fetch_vs_bare_tcp": rates["fetch"] / rates["bare_tcp"],
                                    "fetch_vs_bare_grpc": rates["fetch"] / rates["bare_grpc"],
                                    "fill_vs_bare_tcp": rates["fill"] / rates["bare_tcp"],
                                    "fill_block_port_vs_bare_tcp": rates["fill_block_port"] / rates["bare_tcp"],
                                    "fill_block_port_warm_vs_bare_tcp":
                                        rates["fill_block_port_warm"] / rates["bare_tcp"]},
                                   indent=1) + "\n")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
