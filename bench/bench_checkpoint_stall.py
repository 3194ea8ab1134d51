"""What a checkpoint costs the daemon's event loop: its stalls, measured in one process.

    python bench/bench_checkpoint_stall.py [--resident 1000000] [--rate 50000] [--seconds 20]
                                           [--rounds 2] [--evict] [--modes none loop whole]
                                           [--out bench/results/checkpoint_stall.json]

The stream benchmark (bench_recovery's checkpoint cost) runs five processes on the machine and
its p99 is mostly the machine's load; this one measures the part a checkpoint adds in the
daemon itself. One asyncio loop holds the daemon's reducer state (``--cpu-blocks`` CPU-tier
blocks in chains of 256, then ``--resident`` GPU blocks as shape c stores them: single-hash
``BlockStored``, 100 per record) and runs, for ``--seconds``: a feeder applying shape c
records at ``--rate`` block events/s, the daemon's collector policy (``gc.freeze`` four times a
second), a probe that sleeps 1 ms and records how late it woke, once per millisecond due
meanwhile (the loop's lag as a message arriving every ms would see it: a 15 ms stall is 15
samples, 15 ms down to 0), and the daemon's Checkpointer
(offloadd.log.checkpoint, on a real Redis started here) writing a checkpoint every
``--interval-s``. Modes, alternating each round on a state rebuilt the same way: ``none`` (no
checkpoint), ``loop`` (the default: what changed is cut in the loop, in slices),
``fork`` (``checkpoint_fork_blocks`` 0: every export in a forked child) and ``whole`` (the
default but a tier with removals cut whole, as before DECISIONS 68). With ``--evict`` the GPU
tier removes its 100 oldest blocks in each record (one BlockRemoved each), as a vLLM GPU tier
in steady state does. Each run first writes
one checkpoint of the whole state, not measured (a restarted daemon's first one). Reported per
run: lag p50/p99/p99.9/max, checkpoints written, forks, the blocks cut, the chunk bytes sent,
Redis's AOF rewrites during the run, its AOF size and used memory at the end, and the CPU
seconds of this process and of its children (the export children). With ``--record-us`` each
record also costs that much CPU in the loop (the daemon's gRPC, decoding and Redis work per
batch): a loop that is that busy shows whether the export's slices leave it room (how late
each record was applied, ``record_late_ms``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from events.checkpoint_cut import preload
from events.logkeys import LogKeys
from events.schema import BlockRemoved, BlockStored, Event, LogRecord
from events.state import CacheState
from offloadd.config import OffloaddConfig
from offloadd.log.checkpoint import Checkpointer
from offloadd.log.metadata import MetadataStore
from tests.support.redis_proc import RedisProcess

EPOCH = "e" * 16
TOKENS = tuple(range(16))


class Feed:
    """Shape c records for one GPU source, and CPU-tier chains for another."""

    def __init__(self, state: CacheState) -> None:
        self.state, self.seq, self.next_hash = state, 0, 1
        self.oldest = 1

    def gpu(self, evict: bool = False) -> None:
        """100 single-block stores; ``evict``: and the 100 oldest blocks removed, one
        BlockRemoved each (a vLLM GPU tier in steady state, LRU)."""
        self.seq += 1
        h = self.next_hash
        self.next_hash += 100
        events: tuple[Event, ...] = tuple(BlockStored((h + j,), None, TOKENS, 16, "GPU") for j in range(100))
        if evict:
            events += tuple(BlockRemoved((o,), "GPU") for o in range(self.oldest, self.oldest + 100))
            self.oldest += 100
        self.state.apply(LogRecord(self.state.offset + 1, "engine", 1, self.seq, 0.0, events))

    def cpu(self, n: int) -> None:
        h = 1 << 40
        for i in range(n // 256):
            hashes = tuple(range(h + 256 * i, h + 256 * (i + 1)))
            self.state.apply(LogRecord(self.state.offset + 1, "offloadd", 1, i + 1, 0.0,
                                       (BlockStored(hashes, None, TOKENS * 256, 16, "CPU"),)))


async def one_run(url: str, mode: str, args: argparse.Namespace, run: int) -> dict[str, Any]:
    client = aioredis.Redis.from_url(url)
    await client.flushall()
    keys = LogKeys(f"stall{run}")
    await client.set(keys.epoch, EPOCH)
    state = CacheState()
    feed = Feed(state)
    feed.cpu(args.cpu_blocks)
    for _ in range(args.resident // 100):
        feed.gpu()
    gc.collect()
    gc.freeze()
    md = MetadataStore(client, keys, state)
    cp = Checkpointer(md, OffloaddConfig(namespace=keys.namespace, checkpoint_fork_blocks=(
        0 if mode == "fork" else OffloaddConfig.checkpoint_fork_blocks)), EPOCH)
    cp.track_removals = mode != "whole"
    if mode != "none":
        await cp.write()  # the whole state once, as after a restart: not measured
    preload()  # what Checkpointer.run imports in a thread before its first cut (the daemon's)
    aof0 = await client.info("persistence")
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    behind: list[float] = []  # how late each record was applied: the stream's queueing
    cut: list[int] = []
    stop = loop.time() + args.seconds
    cpu0, kids0 = time.process_time(), os.times()

    async def probe() -> None:
        while loop.time() < stop:
            t = loop.time()
            await asyncio.sleep(0.001)
            late = loop.time() - t - 0.001
            # Each 1 ms tick due meanwhile counts (a message a ms would each have waited): a
            # 15 ms stall is 15 samples, not one (no coordinated omission).
            lags.extend(late - k * 0.001 for k in range(int(late / 0.001) + 1))

    async def feeder() -> None:
        start, n = loop.time(), 0
        while loop.time() < stop:
            n += 1
            due = start + n * 100 / args.rate
            feed.gpu(args.evict)
            if args.record_us:  # the rest of the daemon's work per batch (gRPC, decode, Redis)
                until = time.perf_counter() + args.record_us * 1e-6
                while time.perf_counter() < until:
                    pass
            behind.append(max(0.0, loop.time() - due))
            await asyncio.sleep(max(0.0, due - loop.time()))

    async def collector() -> None:
        while loop.time() < stop:
            await asyncio.sleep(0.25)
            gc.freeze()

    sent: list[int] = []
    forks = 0

    async def checkpoints() -> None:
        nonlocal forks
        while loop.time() + args.interval_s < stop:
            await asyncio.sleep(args.interval_s)
            if await cp.write() is not None:
                cut.append(cp.stats.blocks_cut)
                sent.append(cp.stats.bytes_sent)
                forks += cp.stats.forked

    tasks = [probe(), feeder(), collector()] + ([checkpoints()] if mode != "none" else [])
    await asyncio.gather(*tasks)
    cpu, kids = time.process_time() - cpu0, os.times()
    aof = await client.info("persistence")
    used = (await client.info("memory"))["used_memory"]
    await client.aclose()
    lags.sort()
    q = statistics.quantiles(lags, n=1000)
    behind.sort()
    b = statistics.quantiles(behind, n=100)
    return {"mode": mode, "lag_ms": {"p50": round(q[499] * 1e3, 3), "p99": round(q[989] * 1e3, 3),
                                     "p99.9": round(q[998] * 1e3, 3), "max": round(lags[-1] * 1e3, 3)},
            "record_late_ms": {"p50": round(b[49] * 1e3, 3), "p99": round(b[98] * 1e3, 3),
                               "max": round(behind[-1] * 1e3, 3)},
            "samples": len(lags), "checkpoints": len(cut), "blocks_cut_max": max(cut, default=0),
            "blocks_cut_median": statistics.median(cut) if cut else 0, "forks": forks,
            "bytes_sent_mb": round(sum(sent) / 1e6, 1), "aof_rewrites": (
                aof["aof_rewrites"] - aof0["aof_rewrites"]) if "aof_rewrites" in aof else None,
            "aof_mb": round(aof.get("aof_current_size", 0) / 1e6, 1),
            "used_memory_mb": round(used / 1e6, 1),
            "forked": cp.stats.forked, "cpu_s": round(cpu, 2),
            "children_cpu_s": round(kids.children_user + kids.children_system
                                    - kids0.children_user - kids0.children_system, 2),
            "resident_end": sum(state.counts().values()), "load_1m": round(os.getloadavg()[0], 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-blocks", type=int, default=100_000, help="CPU-tier blocks resident")
    p.add_argument("--resident", type=int, default=1_000_000, help="GPU blocks resident at the start")
    p.add_argument("--rate", type=float, default=50_000.0, help="block events/s applied meanwhile")
    p.add_argument("--seconds", type=float, default=20.0, help="length of each run")
    p.add_argument("--interval-s", type=float, default=2.0, help="checkpoint interval")
    p.add_argument("--record-us", type=float, default=0.0,
                   help="CPU spent per record besides applying it (the daemon's other work per batch)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of the three modes")
    p.add_argument("--evict", action="store_true",
                   help="the GPU tier evicts its oldest blocks as fast as it stores (steady state)")
    p.add_argument("--modes", nargs="+", default=["none", "loop", "fork"],
                   choices=["none", "loop", "fork", "whole"],
                   help="whole: in the loop, but a tier with removals cut whole (before DECISIONS 68)")
    p.add_argument("--out", default="bench/results/checkpoint_stall.json")
    args = p.parse_args()
    if args.rounds < 1 or args.seconds <= args.interval_s:
        p.error("--rounds must be >= 1 and --seconds longer than --interval-s")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-stall-") as tmp:
        redis_proc = RedisProcess(Path(tmp))
        redis_proc.start()
        try:
            for r in range(args.rounds):
                for mode in args.modes:
                    row = asyncio.run(one_run(redis_proc.url, mode, args, len(runs)))
                    runs.append({"round": r + 1, **row})
                    print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
        finally:
            redis_proc.stop()
    summary = {m: {k: statistics.median(r["lag_ms"][k] for r in runs if r["mode"] == m)
                   for k in ("p50", "p99", "p99.9", "max")} for m in args.modes}
    doc = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
           "args": vars(args), "runs": runs, "median_lag_ms": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for m, s in summary.items():
        print(f"{m:>5}: loop lag p50 {s['p50']:.2f} ms, p99 {s['p99']:.2f} ms, p99.9 {s['p99.9']:.2f} ms, "
              f"max {s['max']:.1f} ms (medians of {args.rounds})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
