"""The whole event path, end to end: engine stream -> offloadd -> Redis -> kv-bridge -> ZMQ SUB.

    python bench/bench_pipeline.py [--shape a|b|c ...] [--scale 1.0] [--out bench/results/pipeline.json]

What the user of the stream experiences: engines publish GPU-tier batches on EventIngest.Publish
streams (real gRPC, one process per stream, its messages built before the clock starts so the
client is not the limit),
a real ``offloadd`` fences and appends them to its Redis log, a real ``kv-bridge`` republishes the
log in vLLM's wire format, and this process subscribes on SUB, checks that the published seq is
contiguous and counts every block event (nothing lost). Shapes (issue "durable core"):

- **a**: vLLM's own publisher test: 10,000 batches of 100 single-hash ``BlockStored`` on one
  stream (vLLM's in-process publisher delivers >= 9,000 of them within 10 s);
- **b**: 8 streams at once, batches of 16-256 hashes (~150k block events/s is the goal);
- **c**: latency at a paced 50k block events/s (engine send -> subscriber receive, p50/p99).

Baselines measured in the same run on the same payloads: **bare PUB->SUB** (the batches, already
in vLLM's wire format, on one ZMQ socket) and **bare Redis XADD** (the same log records,
pipelined 500 per MULTI/EXEC, as fast as one client can). Results: ratios to both.
Each pipeline row also has the CPU that offloadd, kv-bridge and Redis used over the measured run
(``cpu``: seconds and seconds per 1M block events, from /proc) and what Redis's AOF rewrite
children used (``redis.children_cpu_s``): on a 2-core machine their sum is what decides the rate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import queue
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import redis
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcache.v1 import log_pb2, log_pb2_grpc

from bench.sub_receiver import receive, subscribe
from events.codec_proto import EventBatch, batch_to_proto
from events.codec_vllm import encode_batch
from events.logkeys import LogKeys
from events.records import RECORD_FIELD, encode_record, entry_id
from events.schema import BlockStored, Event, LogRecord
from tests.support.bridge_proc import BridgeProcess
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_proc import RedisProcess, free_port

BLOCK_SIZE = 16


def shape_batches(shape: str, scale: float, seed: int = 0) -> list[list[tuple[Event, ...]]]:
    """Per stream, the event tuples of its batches (one tuple = one batch = one log record)."""
    rng = random.Random(seed)
    if shape in ("a", "c"):
        streams, n, sizes = 1, int(10_000 * scale), (100, 100)
    else:
        streams, n, sizes = 8, int(2_000 * scale), (16, 256)
    out: list[list[tuple[Event, ...]]] = []
    next_hash = 1
    for _ in range(streams):
        batches: list[tuple[Event, ...]] = []
        for _ in range(n):
            k = rng.randint(*sizes)
            if shape == "b":  # one event of k chained hashes
                hashes = tuple(range(next_hash, next_hash + k))
                batches.append((BlockStored(hashes, None, tuple(range(k * BLOCK_SIZE)),
                                            BLOCK_SIZE, "GPU"),))
            else:  # vLLM's test: k single-hash events
                batches.append(tuple(BlockStored((next_hash + j,), None, tuple(range(BLOCK_SIZE)),
                                                 BLOCK_SIZE, "GPU") for j in range(k)))
            next_hash += k
        out.append(batches)
    return out


def block_events(batch: tuple[Event, ...]) -> int:
    return sum(len(e.block_hashes) for e in batch if isinstance(e, BlockStored))


# -- the engine side: one process per Publish stream ---------------------------------------------

def engine_stream(target: str, engine_id: str, batches: list[tuple[Event, ...]],
                  block_events_per_s: float | None, result: Any, ready: Any, go: Any) -> None:
    """Publish every batch on one stream (paced or not); put (acked, applied, seconds). The
    messages are built first (put on ``ready``); the stream starts when ``go`` is set."""
    n = len(batches)
    total = sum(block_events(b) for b in batches)
    pace = None if block_events_per_s is None else total / block_events_per_s / n

    msgs = [batch_to_proto(EventBatch(engine_id, 1, i + 1, 0.0, events))
            for i, events in enumerate(batches)]  # built before the clock starts
    ready.put(engine_id)
    go.wait()

    def requests() -> Any:
        start = time.time()
        for i, msg in enumerate(msgs):
            if pace is not None:
                delay = start + i * pace - time.time()
                if delay > 0:
                    time.sleep(delay)
            msg.ts = time.time()
            yield msg

    t0 = time.perf_counter()
    applied = 0
    with grpc.insecure_channel(target) as ch:
        for ack in log_pb2_grpc.EventIngestStub(ch).Publish(requests(), timeout=600):
            applied += ack.status == log_pb2.PublishAck.STATUS_APPLIED
    result.put((engine_id, applied, time.perf_counter() - t0))


def receive_row(sub: zmq.Socket[bytes], n: int, idle_s: float) -> dict[str, Any]:
    got = receive(sub, idle_s, batches=n)
    return {"received": got.batches, "gaps": got.gaps, "seconds": got.seconds,
            "p50_ms": got.p50_ms, "p99_ms": got.p99_ms}


def run_pipeline(work: Path, streams: list[list[tuple[Event, ...]]],
                 block_events_per_s: float | None, daemon_args: tuple[str, ...] = (),
                 prepare: Callable[[str], object] | None = None,
                 capacity_bytes: int = 1 << 20, redis_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """One run of the whole path; ``prepare(daemon target)`` runs before the bridge starts
    (bench_recovery fills the CPU tier there), ``daemon_args`` go to offloadd, ``redis_args``
    to redis-server."""
    redis_proc = RedisProcess(work / f"redis-{time.monotonic_ns()}", extra_args=redis_args)
    redis_proc.start()
    daemon = DaemonProcess(work / f"offloadd-{time.monotonic_ns()}", redis_proc.url, "default",
                           capacity_bytes=capacity_bytes,
                           extra_args=("--log-level", "WARNING", *daemon_args))
    daemon.start()
    if prepare is not None:
        prepare(daemon.target)
    bridge = BridgeProcess(redis_proc.url, work / f"bridge-{time.monotonic_ns()}",
                           "--log-level", "WARNING")
    bridge.start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = subscribe(ctx, bridge.pub)
    time.sleep(1.0)
    spawn = mp.get_context("spawn")
    results: Any = spawn.Queue()
    ready: Any = spawn.Queue()
    go = spawn.Event()
    procs = [spawn.Process(target=engine_stream,
                           args=(daemon.target, f"engine-{i}", batches,
                                 None if block_events_per_s is None else block_events_per_s / len(streams),
                                 results, ready, go))
             for i, batches in enumerate(streams)]
    n = sum(len(b) for b in streams)
    total = sum(block_events(b) for s in streams for b in s)
    services = {"offloadd": daemon.proc, "kv-bridge": bridge.proc, "redis": redis_proc.proc}
    try:
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=120)
        cpu0 = {name: cpu_seconds(proc) for name, proc in services.items()}
        t0 = time.time()
        go.set()
        got = receive_row(sub, n, idle_s=20.0)
        wall = time.time() - t0
        cpu = {name: cpu_used(cpu0[name], cpu_seconds(proc), total)
               for name, proc in services.items()}
        for p in procs:
            p.join(60)
        engines = []
        for _ in procs:  # an engine whose stream failed reports nothing: counted below
            with contextlib.suppress(queue.Empty):
                engines.append(results.get(timeout=5))
        stalls = redis_counters(redis_proc.url)
    finally:
        ctx.destroy(linger=0)
        bridge.stop()
        daemon.stop()
        redis_proc.stop()
    applied = sum(a for _, a, _ in engines)
    written = [int(b) for b in re.findall(r" written: offset \d+, \d+ chunks, (\d+) bytes",
                                          daemon.log_path.read_text(errors="replace"))]
    sent = [int(b) for b in re.findall(r" written: offset \d+, \d+ chunks, \d+ bytes; (\d+) bytes new",
                                       daemon.log_path.read_text(errors="replace"))]
    forks_ms = [float(a) for a in re.findall(r"\(forked in ([\d.]+) ms\)",
                                             daemon.log_path.read_text(errors="replace"))]
    cut = [int(b) for b in re.findall(r" bytes new; (\d+) blocks cut", daemon.log_path.read_text(errors="replace"))]
    return {"batches": n, "block_events": total, "applied": applied, **got,
            "checkpoint_fork_ms_max": max(forks_ms, default=None), "checkpoint_forks": len(forks_ms),
            "checkpoint_blocks_cut_max": max(cut, default=None),
            "checkpoints": len(written), "checkpoint_bytes_max": max(written, default=0),
            "checkpoint_bytes_total": sum(written),
            "checkpoint_bytes_sent_total": sum(sent) if sent else sum(written), "redis": stalls,
            "engines_failed": len(procs) - len(engines), "cpu": cpu,
            "lost": n - got["received"], "wall_s": wall,
            "block_events_per_s": total / wall if got["received"] == n else None,
            "within_10s": got["received"] if wall <= 10 else None}


def cpu_seconds(proc: Any) -> float | None:
    """User + system CPU seconds of a running child (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (AttributeError, OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_used(before: float | None, after: float | None, block_events: int) -> dict[str, Any]:
    """A process's CPU over the measured run, in all and per million block events (what decides
    the rate when five processes share the cores; AOF rewrite children are not counted)."""
    if before is None or after is None:
        return {"cpu_s": None, "cpu_s_per_1m_events": None}
    used = after - before
    return {"cpu_s": round(used, 2), "cpu_s_per_1m_events": round(used / block_events * 1e6, 2)}


def redis_counters(url: str) -> dict[str, float]:
    """What Redis did in the run that can stall every client: forks (AOF rewrites, each a copy
    of the dataset's page tables), writes it made wait for a slow fsync, and the CPU its
    rewrite children used (on the same cores as the rest)."""
    admin = redis.Redis.from_url(url)
    try:
        info = {**admin.info("persistence"), **admin.info("stats"), **admin.info("cpu")}
    finally:
        admin.close()
    out: dict[str, float] = {k: int(info.get(k, 0)) for k in (
        "aof_rewrites", "aof_delayed_fsync", "total_forks", "latest_fork_usec")}
    out["children_cpu_s"] = round(float(info.get("used_cpu_user_children", 0))
                                  + float(info.get("used_cpu_sys_children", 0)), 2)
    return out


# -- baselines ----------------------------------------------------------------------------------

def bare_publisher(endpoint: str, payloads: list[bytes]) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(endpoint)
    time.sleep(1.0)
    for i, payload in enumerate(payloads):
        pub.send_multipart([b"kv-events", i.to_bytes(8, "big"), payload])
    time.sleep(0.5)
    pub.close(linger=5000)
    ctx.term()


def run_bare(streams: list[list[tuple[Event, ...]]]) -> dict[str, Any]:
    batches = [b for s in streams for b in s]
    payloads = [encode_batch(b, time.time()) for b in batches]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = subscribe(ctx, endpoint)
    proc = mp.get_context("spawn").Process(target=bare_publisher, args=(endpoint, payloads))
    proc.start()
    try:
        got = receive_row(sub, len(batches), idle_s=10.0)
    finally:
        proc.join(60)
        ctx.destroy(linger=0)
    total = sum(block_events(b) for b in batches)
    return {**got, "block_events_per_s": total / max(got["seconds"], 1e-9)}


def run_xadd(work: Path, streams: list[list[tuple[Event, ...]]],
             redis_args: tuple[str, ...] = ()) -> dict[str, Any]:
    redis_proc = RedisProcess(work / f"redis-xadd-{time.monotonic_ns()}", extra_args=redis_args)
    redis_proc.start()
    client = redis.Redis.from_url(redis_proc.url)
    keys = LogKeys()
    batches = [b for s in streams for b in s]
    records = [encode_record(LogRecord(i + 1, "engine-0", 1, i + 1, time.time(), b))
               for i, b in enumerate(batches)]
    try:
        t0 = time.perf_counter()
        for start in range(0, len(records), 500):
            pipe = client.pipeline(transaction=True)
            for i in range(start, min(len(records), start + 500)):
                pipe.xadd(keys.log, {RECORD_FIELD: records[i]}, id=entry_id(i + 1))
            pipe.execute()
        seconds = time.perf_counter() - t0
    finally:
        client.close()
        redis_proc.stop()
    total = sum(block_events(b) for b in batches)
    return {"records": len(records), "seconds": seconds, "block_events_per_s": total / seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", action="append", choices=["a", "b", "c"],
                    help="which shapes (default all)")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each shape's batches")
    ap.add_argument("--rate", type=float, default=50_000, help="block events/s of shape c")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of shape c")
    ap.add_argument("--aof-min-size", default="512mb",
                    help="redis-server --auto-aof-rewrite-min-size of the pipeline's Redis: 512mb as\n"
                         "kv-stack and compose run it (DECISIONS 68); '' for Redis's default (64mb)")
    ap.add_argument("--out", default="bench/results/pipeline.json")
    args = ap.parse_args()
    shapes = args.shape or ["a", "b", "c"]
    redis_args = ("--auto-aof-rewrite-min-size", args.aof_min_size) if args.aof_min_size else ()
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        work = Path(tmp)
        for shape in shapes:
            if shape == "c":
                per_batch = 100
                n = int(args.rate * args.seconds / per_batch)
                streams = shape_batches("c", n / 10_000)
                pipeline = run_pipeline(work, streams, args.rate, redis_args=redis_args)
            else:
                streams = shape_batches(shape, args.scale)
                pipeline = run_pipeline(work, streams, None, redis_args=redis_args)
            bare = run_bare(streams)
            xadd = run_xadd(work, streams, redis_args)
            rows[shape] = {"pipeline": pipeline, "bare_pub_sub": bare, "bare_xadd": xadd}
            rate = pipeline["block_events_per_s"]
            print(f"shape {shape}: {pipeline['batches']} batches, {pipeline['block_events']:,} block "
                  f"events; received {pipeline['received']} (lost {pipeline['lost']}, gaps "
                  f"{pipeline['gaps']}) in {pipeline['wall_s']:.1f} s")
            if rate:
                print(f"  pipeline {rate:,.0f} block ev/s = {rate / bare['block_events_per_s']:.3f}x "
                      f"bare PUB->SUB ({bare['block_events_per_s']:,.0f}), "
                      f"{rate / xadd['block_events_per_s']:.3f}x bare XADD "
                      f"({xadd['block_events_per_s']:,.0f})")
            print("  CPU per 1M block events: " + ", ".join(
                f"{name} {row['cpu_s_per_1m_events']} s" for name, row in pipeline["cpu"].items()))
            if shape == "c":
                print(f"  latency at {args.rate:,.0f} block ev/s: p50 {pipeline['p50_ms']:.1f} ms, "
                      f"p99 {pipeline['p99_ms']:.1f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"host": platform.node(), "args": vars(args), "shapes": rows},
                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
