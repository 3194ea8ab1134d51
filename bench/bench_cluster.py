"""Several nodes' namespaces on a Redis Cluster vs one standalone Redis; failover times.

    python bench/bench_cluster.py [--namespaces 1,2,4] [--batches 300] [--rounds 3]
                                  [--out bench/results/cluster.json]

**Ingest.** Per namespace one real ``offloadd`` (a node's daemon) and two engine streams on
EventIngest.Publish (one process each, bench_pipeline's engine side: batches of 16-256 chained
GPU hashes built before the clock starts). The clock runs from "go" to the last stream's last
ack: every batch fenced, appended to the namespace's Redis log (one Lua script per write group)
and acknowledged. Measured with 1, 2 and 4 namespaces on one standalone Redis and on a
3-primary/3-replica cluster on loopback (each namespace's keys on one shard, namespaces spread),
and on the cluster with ``--redis-wait-replicas 1`` (each write acknowledged once a replica has
it: the cost of WAIT). Everything shares the machine's cores: read ratios, not absolute rates.

**Write latency.** Sequential calls of a small write script (an XADD and a SET of 3 KB) on
the cluster, without and with WAIT 1 pipelined after each, exactly as offloadd issues them
(offloadd.log.replica_wait): the per-write cost of ``--redis-wait-replicas 1``.

**Failover.** One daemon on the cluster (no WAIT) with a storer committing chains in a loop; the
primary of its namespace's slot is SIGKILLed; measured: kill -> replica promoted (CLUSTER SLOTS,
polled every 10 ms) and kill -> the first store committed after it (writes accepted again). The killed node is
restarted as a replica between rounds. With WAIT, writes are accepted again only once the new
primary has a replica: measured from the killed node's restart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipeline import block_events, engine_stream, shape_batches

from events.logkeys import LogKeys
from offloadd.log.replica_wait import WaitedScript
from rpc.redis_connect import connect_async
from tests.cluster.stack import namespaces_on_shards
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_cluster import RedisCluster
from tests.support.redis_proc import RedisProcess
from tests.support.synthetic_engine import SLOT, SyntheticStorer

STREAMS_PER_NS = 2


def ingest(work: Path, url: str, namespaces: list[str], batches: int,
           daemon_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """Aggregate acked block events/s of ``len(namespaces)`` daemons, two streams each."""
    daemons = [DaemonProcess(work / f"d-{ns}-{time.monotonic_ns()}", url, ns,
                             extra_args=("--log-level", "WARNING", *daemon_args))
               for ns in namespaces]
    spawn = mp.get_context("spawn")
    results: Any = spawn.Queue()
    ready: Any = spawn.Queue()
    go = spawn.Event()
    streams = shape_batches("b", batches / 2000, seed=len(namespaces))[: len(namespaces) * STREAMS_PER_NS]
    procs = []
    try:
        for d in daemons:
            d.start()
        for i, batches_of in enumerate(streams):
            target = daemons[i // STREAMS_PER_NS].target
            procs.append(spawn.Process(target=engine_stream, args=(
                target, f"engine-{i}", batches_of, None, results, ready, go)))
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=120)
        t0 = time.perf_counter()
        go.set()
        done = [results.get(timeout=600) for _ in procs]
        wall = time.perf_counter() - t0
        for p in procs:
            p.join(30)
    finally:
        for d in daemons:
            d.stop()
    total = sum(block_events(b) for s in streams for b in s)
    n = sum(len(s) for s in streams)
    applied = sum(a for _, a, _ in done)
    return {"namespaces": len(namespaces), "streams": len(streams), "batches": n,
            "applied": applied, "block_events": total, "wall_s": wall,
            "block_events_per_s": total / wall, "batches_per_s": n / wall}


_WRITE = """
redis.call('XADD', KEYS[2], '*', 'r', ARGV[1])
redis.call('SET', KEYS[1], ARGV[1])
return {'ok'}
"""


def write_latency(url: str, wait: bool, n: int) -> dict[str, Any]:
    """Sequential write-script calls (an XADD and a SET of ~3 KB, as a small log write) on the
    namespace's shard, with and without WAIT 1 after each (offloadd.log.replica_wait)."""

    async def run() -> list[float]:
        client = connect_async(url, socket_timeout=2.0)
        script: Any = client.register_script(_WRITE)
        call = WaitedScript(client, script, 1, 1000) if wait else script
        keys = LogKeys("latency")
        out = []
        payload = b"x" * 3000
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                await call(keys=[keys.head, keys.log], args=[payload])
                out.append(time.perf_counter() - t0)
        finally:
            await client.aclose()
        return out

    lat = sorted(asyncio.run(run()))
    return {"wait_replicas": int(wait), "calls": n, "p50_ms": lat[n // 2] * 1000,
            "p99_ms": lat[int(n * 0.99)] * 1000, "calls_per_s": n / sum(lat)}


def _wait_stores(storer: SyntheticStorer, more_than: int, timeout_s: float) -> float | None:
    t0 = time.monotonic()
    while storer.stats.stores <= more_than:
        if time.monotonic() - t0 > timeout_s:
            return None
        time.sleep(0.005)
    return time.monotonic() - t0


def failover(work: Path, rounds: int, node_timeout_ms: int, wait: bool) -> list[dict[str, Any]]:
    cluster = RedisCluster(work / f"fo-{time.monotonic_ns()}", node_timeout_ms=node_timeout_ms)
    cluster.start()
    keys = LogKeys("failover")
    extra = ("--log-level", "ERROR", *(("--redis-wait-replicas", "1", "--redis-wait-timeout-ms", "300")
                                        if wait else ()))
    daemon = DaemonProcess(work / f"fo-d-{time.monotonic_ns()}", cluster.url, keys.namespace,
                           capacity_bytes=64 * SLOT, lease_ms=500, extra_args=extra)
    out: list[dict[str, Any]] = []
    storer = None
    try:
        daemon.start()
        storer = SyntheticStorer(daemon.target, "fo-store", chain_len=4).start()
        for _ in range(rounds):
            _wait_stores(storer, storer.stats.stores + 20, 30.0)
            primary, replica = cluster.node_of_key(keys.head)
            assert replica is not None
            before = storer.stats.stores
            primary.stop(kill=True)
            t0 = time.monotonic()
            while cluster.node_of_key(keys.head)[0].port != replica.port:
                time.sleep(0.01)
            promoted = time.monotonic() - t0
            row: dict[str, Any] = {"node_timeout_ms": node_timeout_ms, "wait_replicas": int(wait),
                                   "promoted_s": promoted}
            if wait:
                primary.start()
                t1 = time.monotonic()
                back = _wait_stores(storer, before, 60.0)
                row["replica_restarted_s"] = t1 - t0
                row["accepted_s"] = None if back is None else t1 - t0 + back
                row["accepted_after_replica_back_s"] = back
            else:
                back = _wait_stores(storer, before, 60.0)
                row["accepted_s"] = None if back is None else time.monotonic() - t0
                primary.start()  # back as the new primary's replica for the next round
            cluster.wait_ok()
            row["daemon_alive"] = daemon.proc is not None and daemon.proc.poll() is None
            print(f"  failover (node timeout {node_timeout_ms} ms, wait {int(wait)}): {row}", flush=True)
            out.append(row)
    finally:
        if storer is not None:
            storer.stop()
        daemon.kill()
        cluster.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--namespaces", default="1,2,4", help="namespace counts to measure")
    ap.add_argument("--batches", type=int, default=300, help="batches per engine stream")
    ap.add_argument("--rounds", type=int, default=3, help="failover rounds per setting")
    ap.add_argument("--repeats", type=int, default=1, help="ingest runs per setting (interleaved)")
    ap.add_argument("--no-failover", action="store_true", help="no failover rounds")
    ap.add_argument("--no-ingest", action="store_true", help="no ingest runs")
    ap.add_argument("--latency-calls", type=int, default=2000, help="write-script calls per latency run")
    ap.add_argument("--out", default="bench/results/cluster.json")
    args = ap.parse_args()
    counts = [int(c) for c in args.namespaces.split(",")]
    rows: list[dict[str, Any]] = []
    latency: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        work = Path(tmp)
        cluster = RedisCluster(work / "cluster", node_timeout_ms=2000)
        cluster.start()
        standalone = RedisProcess(work / "standalone")
        standalone.start()
        try:
            pool = [*namespaces_on_shards(cluster, 3), *(f"extra-{i}" for i in range(max(counts)))]
            for rep, n in ((rep, n) for rep in range(0 if args.no_ingest else args.repeats) for n in counts):
                names = pool[:n]  # the first three on three shards
                shards = len({cluster.node_of_key(LogKeys(x).head)[0].port for x in names})
                for label, url, extra in (("standalone", standalone.url, ()),
                                          ("cluster", cluster.url, ()),
                                          ("cluster+wait1", cluster.url,
                                           ("--redis-wait-replicas", "1", "--redis-wait-timeout-ms", "500"))):
                    r = ingest(work, url, names, args.batches, extra)
                    r["redis"], r["shards"], r["repeat"] = label, 1 if label == "standalone" else shards, rep
                    rows.append(r)
                    print(f"{label:14s} {n} namespaces ({r['shards']} shards): "
                          f"{r['block_events_per_s']:,.0f} block ev/s, {r['batches_per_s']:,.0f} "
                          f"batches/s, applied {r['applied']}/{r['batches']}", flush=True)
                    _flush(cluster, standalone)
            for wait in (False, True, False, True):
                row = write_latency(cluster.url, wait, args.latency_calls)
                latency.append(row)
                print(f"write script on the cluster, wait {row['wait_replicas']}: p50 "
                      f"{row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms", flush=True)
        finally:
            cluster.stop()
            standalone.stop()
        fo = [] if args.no_failover else failover(work, args.rounds, 1000, wait=False)
        fo += [] if args.no_failover else failover(work, max(1, args.rounds - 2), 1000, wait=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    medians = {f"{label} x{n}": statistics.median(r["block_events_per_s"] for r in rows
                                                   if r["redis"] == label and r["namespaces"] == n)
               for label in ("standalone", "cluster", "cluster+wait1") for n in counts} if rows else {}
    for k, v in medians.items():
        print(f"median {k}: {v:,.0f} block ev/s")
    out.write_text(json.dumps({"host": platform.node(), "cpus": _cpus(), "args": vars(args),
                               "load_avg_end": _load(), "ingest_median_block_events_per_s": medians,
                               "ingest": rows, "write_latency": latency, "failover": fo}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def _flush(cluster: RedisCluster, standalone: RedisProcess) -> None:
    """Empty both between runs, so each run starts on fresh namespaces."""
    import redis

    for port in [n.port for n in cluster.nodes] + [standalone.port]:
        client = redis.Redis(port=port)
        try:
            if port == standalone.port or client.execute_command("ROLE")[0] == b"master":
                client.flushall()
        finally:
            client.close()


def _load() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    raise SystemExit(main())
