"""kv-ingest end to end: vLLM-style publishers -> kv-ingest -> offloadd -> Redis -> kv-bridge -> SUB.

    python bench/bench_ingest.py [--shape a|b ...] [--scale 1.0] [--rounds 1] [--out bench/results/ingest.json]

Throughput: the shapes of bench/bench_pipeline.py (a: 10,000 batches of 100 single-hash
BlockStored from one engine; b: 8 engines, 2,000 batches each of 16-256 chained hashes),
published by vLLM-style publishers (ingest.vllm_publisher, one process per engine, payloads
encoded before the clock starts) that kv-ingest follows; this process subscribes to the bridge
and checks the seq is contiguous and every batch arrives (nothing lost). The baseline, in the
same run on the same batches: the same pipeline fed by EventIngest directly
(bench_pipeline.run_pipeline, protos built before the clock starts). Goal: >= 0.8 of it.

Recovery (goal < 1 s each, from the moment the publisher sends to the moment the bridge's
subscriber has everything):
- restart: a followed publisher restarts (new life on the same ports, seq from 0; it waits
  0.5 s before its first batch, as a restarting engine does long before its first step) and
  publishes one batch: until the bridge publishes the new life (the source cleared, then the
  batch);
- gap: 1,000 batches (one BlockStored of 16 chained hashes each, a prefill step's worth) are lost
  on the way and kept in the ring, then one batch is sent: until all 1,001 are at the subscriber.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipeline import block_events, run_pipeline, shape_batches

from bench.sub_receiver import receive, subscribe
from events.codec_vllm import encode_batch
from events.schema import BlockStored, Event
from ingest.vllm_publisher import VllmStylePublisher
from tests.support.bridge_proc import BridgeProcess
from tests.support.ingest_proc import IngestProcess, vllm_endpoints
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_proc import RedisProcess

BLOCK_SIZE = 16


class _Events(msgspec.Struct, array_like=True):
    ts: float
    events: list[dict[str, Any]]


def receive_blocks(sub: zmq.Socket[bytes], block_events: int, idle_s: float) -> dict[str, Any]:
    """Receive until ``block_events`` stored hashes arrived (kv-ingest merges batches that wait
    together, so the bridge publishes fewer, larger batches); seq checked contiguous."""
    got = receive(sub, idle_s, block_events=block_events)
    return {"received_block_events": got.block_events, "received_batches": got.batches,
            "gaps": got.gaps, "seconds": got.seconds, "t_last": got.t_last}


def publisher_proc(pub: str, replay: str, batches: list[tuple[Event, ...]], ready: Any, go: Any) -> None:
    """One vLLM-style engine: payloads encoded first, then sent as fast as the PUB takes them."""
    vllm = VllmStylePublisher(pub, replay)
    payloads = [encode_batch(b, 0.0) for b in batches]
    ready.put(pub)
    go.wait()
    for payload in payloads:
        vllm.publish_payload(payload)
    time.sleep(5.0)  # keep the ring up for a late replay
    vllm.close()


class Stack:
    """Redis, offloadd and kv-bridge, plus a SUB on the bridge."""

    def __init__(self, work: Path) -> None:
        tag = time.monotonic_ns()
        self.redis = RedisProcess(work / f"redis-{tag}")
        self.redis.start()
        self.daemon = DaemonProcess(work / f"offloadd-{tag}", self.redis.url, "default",
                                    extra_args=("--log-level", "WARNING"))
        self.daemon.start()
        self.bridge = BridgeProcess(self.redis.url, work / f"bridge-{tag}", "--log-level", "WARNING")
        self.bridge.start()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sub = subscribe(self.ctx, self.bridge.pub)
        self.work = work

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        self.bridge.stop()
        self.daemon.stop()
        self.redis.stop()


def run_ingest_pipeline(work: Path, streams: list[list[tuple[Event, ...]]]) -> dict[str, Any]:
    stack = Stack(work)
    ends = [vllm_endpoints() for _ in streams]
    ingest = IngestProcess(work / f"ingest-{time.monotonic_ns()}", stack.daemon.target,
                           [f"engine-{i}={p},replay={r}" for i, (p, r) in enumerate(ends)],
                           "--log-level", "WARNING")
    spawn = mp.get_context("spawn")
    ready: Any = spawn.Queue()
    go = spawn.Event()
    procs = [spawn.Process(target=publisher_proc, args=(p, r, b, ready, go))
             for (p, r), b in zip(ends, streams, strict=True)]
    n = sum(len(s) for s in streams)
    total = sum(block_events(b) for s in streams for b in s)
    try:
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=120)
        ingest.start(wait_healthy=True)
        time.sleep(1.0)  # SUB sockets joined (what they miss would come from the rings)
        t0 = time.time()
        go.set()
        got = receive_blocks(stack.sub, total, idle_s=20.0)
        wall = time.time() - t0
        resyncs = ingest.metric("kvingest_resyncs_total")
        garbage = ingest.metric("kvingest_garbage_total")
        for p in procs:
            p.join(60)
    finally:
        ingest.stop()
        stack.close()
    lost = total - got["received_block_events"]
    return {"batches": n, "block_events": total, **got, "lost": lost, "wall_s": wall,
            "block_events_per_s": total / wall if lost == 0 else None,
            "resyncs": resyncs, "garbage": garbage}


def _chain_batch(start: int, k: int = 16) -> tuple[Event, ...]:
    hashes = tuple(range(start, start + k))
    return (BlockStored(hashes, None, tuple(range(k * BLOCK_SIZE)), BLOCK_SIZE, "GPU"),)


def _until(sub: zmq.Socket[bytes], match: Any, timeout_s: float) -> float | None:
    """Time at which a batch whose decoded events satisfy ``match`` arrives."""
    deadline = time.time() + timeout_s
    decoder = msgspec.msgpack.Decoder(_Events)
    while sub.poll(max(1, int((deadline - time.time()) * 1000))):
        frames = sub.recv_multipart()
        if match(decoder.decode(frames[2]).events):
            return time.time()
    return None


def run_recovery(work: Path) -> dict[str, Any]:
    stack = Stack(work)
    pub, replay = vllm_endpoints()
    vllm = VllmStylePublisher(pub, replay)
    ingest = IngestProcess(work / f"ingest-r-{time.monotonic_ns()}", stack.daemon.target,
                           [f"engine-0={pub},replay={replay}"], "--log-level", "WARNING")
    out: dict[str, Any] = {}
    try:
        ingest.start(wait_healthy=True)
        time.sleep(1.0)
        for i in range(100):  # a life with some history
            vllm.publish(_chain_batch(1 + 16 * i))
        warm = receive_blocks(stack.sub, 100 * 16, idle_s=20)
        assert warm["received_block_events"] == 1600, f"warm-up: {warm}"

        # A 1,000-batch gap: lost on the way, kept in the ring; then one batch shows it.
        base = 1_000_000
        for i in range(1000):
            vllm.publish(_chain_batch(base + 16 * i), drop=True)
        t0 = time.time()
        vllm.publish(_chain_batch(base + 16 * 1000))
        got = receive_blocks(stack.sub, 1001 * 16, idle_s=10)
        ok = got["received_block_events"] == 1001 * 16
        out["gap"] = {"batches": 1001, "block_events": 1001 * 16, **got,
                      "seconds": got["t_last"] - t0 if ok else None}

        # A restart: new life on the same ports, first batch 0.5 s later.
        vllm.close()
        vllm = VllmStylePublisher(pub, replay)
        time.sleep(0.5)
        marker = 9_000_000
        t0 = time.time()
        vllm.publish(_chain_batch(marker))
        seen = _until(stack.sub, lambda evs: any(marker in e.get("block_hashes", ()) for e in evs), 30)
        out["restart"] = {"seconds": None if seen is None else seen - t0}
        out["resyncs"] = ingest.metric("kvingest_resyncs_total")
    finally:
        vllm.close()
        ingest.stop()
        stack.close()
    return out


def _direct(work: Path, streams: list[list[tuple[Event, ...]]]) -> dict[str, Any]:
    return run_pipeline(work, streams, None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", action="append", choices=["a", "b"], help="which shapes (default both)")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each shape's batches")
    ap.add_argument("--rounds", type=int, default=1, help="alternating runs of each pipeline; medians")
    ap.add_argument("--no-recovery", action="store_true", help="skip the restart and gap runs")
    ap.add_argument("--out", default="bench/results/ingest.json")
    args = ap.parse_args()
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        work = Path(tmp)
        for shape in args.shape or ["a", "b"]:
            streams = shape_batches(shape, args.scale)
            runs: dict[str, list[dict[str, Any]]] = {"ingest": [], "direct": []}
            for r in range(args.rounds):
                for kind, run in (("ingest", run_ingest_pipeline), ("direct", _direct)):
                    try:
                        row = run(work, streams)
                    except Exception as exc:  # a run that broke (an overloaded machine) is kept as such
                        row = {"failed": f"{type(exc).__name__}: {exc}", "block_events_per_s": None,
                               "lost": None, "gaps": None}
                    runs[kind].append(row)
                    print(f"shape {shape} round {r + 1}/{args.rounds} {kind}: "
                          f"{row['block_events_per_s'] or row.get('failed')}", flush=True)
            rates = {k: [x["block_events_per_s"] for x in v if x["block_events_per_s"]]
                     for k, v in runs.items()}
            med = {k: statistics.median(v) if v else 0.0 for k, v in rates.items()}
            ratio = med["ingest"] / med["direct"] if med["direct"] else None
            rows[shape] = {"runs": runs, "median_block_events_per_s": med, "ratio": ratio}
            lost = sum(x["lost"] + x["gaps"] for x in runs["ingest"] + runs["direct"] if "failed" not in x)
            print(f"shape {shape}: kv-ingest {med['ingest']:,.0f} block ev/s vs EventIngest directly "
                  f"{med['direct']:,.0f}: {ratio or 0:.2f}x (goal >= 0.8); lost+gaps {lost}", flush=True)
        if not args.no_recovery:
            rec = run_recovery(work)
            rows["recovery"] = rec
            print(f"1,000-batch gap recovered in {rec['gap']['seconds']} s; restart in "
                  f"{rec['restart']['seconds']} s (goal < 1 s each)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"host": platform.node(), "args": vars(args), "shapes": rows},
                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
