"""Load: 4 synthetic engines stream KV events and store blocks into one offloadd for a bounded
time on loopback; at the end, zero loss is checked and throughput/latency/memory reported.

Each engine is two threads using the real client: a publisher (IngestStream, GPU-tier
stores/removes, at most ``--max-resident`` blocks held) and a storer (Reserve -> arena write ->
Commit of chains of 8 new blocks; the arena is bounded, so LRU evicts). A private redis-server
and the daemon run as subprocesses. The daemon's RSS is sampled every second.

Checked at the end (exit code 1 when any fails): every batch of every engine is in the log
exactly once and in order (seqs 1..N, one incarnation, none dropped); each engine's GPU tier in
the log equals what it holds; log offsets are contiguous; the reducer over the log equals the
daemon's Snapshot with no violations; every committed block is either in the CPU tier with its
writer's exact bytes or was evicted in the log.

    python bench/bench_load.py [--seconds 60] [--engines 4] [--json out.json] [--no-write]

Writes a ``## Load`` section into docs/RELIABILITY.md (between markers) unless --no-write.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from events.hashing import to_wire  # noqa: E402
from events.schema import BlockRemoved  # noqa: E402
from events.state import CacheState  # noqa: E402
from offloadd.client import OffloadClient  # noqa: E402
from tests.support.offloadd_proc import DaemonProcess  # noqa: E402
from tests.support.redis_proc import RedisProcess  # noqa: E402
from tests.support.synthetic_engine import (  # noqa: E402
    GROUP,
    SLOT,
    SyntheticPublisher,
    SyntheticStorer,
    percentile,
    rss_kb,
    served_blocks_match,
)

BEGIN, END = "<!-- load:begin -->", "<!-- load:end -->"


def run(seconds: float, engines: int, pub_pause_s: float, store_pause_s: float,
        capacity_slots: int, max_resident: int) -> dict[str, Any]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = Path(tempfile.mkdtemp(prefix="kvo-load-", dir=base))
    redis = RedisProcess(work / "redis")
    redis.start()
    daemon = DaemonProcess(work / "d", redis.url, "load", capacity_bytes=capacity_slots * SLOT,
                           chunk_bytes=capacity_slots * SLOT)
    daemon.start()
    pubs = [SyntheticPublisher(daemon.target, f"engine-{i}", incarnation=1, seed=i, pause_s=pub_pause_s,
                               max_resident=max_resident) for i in range(engines)]
    storers = [SyntheticStorer(daemon.target, f"engine-{i}", chain_len=8, pause_s=store_pause_s)
               for i in range(engines)]
    assert daemon.proc is not None
    pid = daemon.proc.pid
    rss: list[int] = [rss_kb(pid)]
    stop = threading.Event()

    def watch_acks() -> None:
        while not stop.is_set():
            for p in pubs:
                p.poll_acks()
            stop.wait(0.001)

    watcher = threading.Thread(target=watch_acks, daemon=True)
    try:
        t0 = time.monotonic()
        watcher.start()
        for p in pubs:
            p.start()
        for s in storers:
            s.start()
        next_sample = t0 + 1.0
        while time.monotonic() - t0 < seconds:
            time.sleep(max(0.0, next_sample - time.monotonic()))
            rss.append(rss_kb(pid))
            next_sample += 1.0
        for p in pubs:
            p.stop()
        for s in storers:
            s.stop()
        elapsed = time.monotonic() - t0
        flushed = all(p.stream.flush(60) for p in pubs)
        for p in pubs:
            p.poll_acks()
        stop.set()
        watcher.join()
        rss.append(rss_kb(pid))
        result = check(daemon, pubs, storers)
        result.update(flushed=flushed, seconds=round(elapsed, 1), engines=engines, rss_kb=rss,
                      pub_pause_ms=pub_pause_s * 1e3, store_pause_ms=store_pause_s * 1e3)
        batches = sum(p.submitted for p in pubs)
        events = batches  # one event per batch
        blocks = sum(len(s.stats.committed) for s in storers)
        acks = [x for p in pubs for x in p.ack_latency_s]
        stores = [x for s in storers for x in s.stats.store_latency_s]
        result.update(
            batches=batches, events_per_s=round(events / elapsed), blocks_committed=blocks,
            blocks_per_s=round(blocks / elapsed), store_mib_per_s=round(blocks * SLOT / elapsed / 2**20, 2),
            ack_ms={q: round(percentile(acks, q) * 1e3, 2) for q in (0.5, 0.9, 0.99, 1.0)},
            store_ms={q: round(percentile(stores, q) * 1e3, 2) for q in (0.5, 0.9, 0.99, 1.0)},
            store_errors=sum(s.stats.errors for s in storers),
            rss_start_mib=round(rss[1 if len(rss) > 2 else 0] / 1024, 1),
            # After the arena and the bounded resident sets have filled up (warm-up).
            rss_quarter_mib=round(rss[max(1, len(rss) // 4)] / 1024, 1),
            rss_end_mib=round(rss[-1] / 1024, 1),
            rss_max_mib=round(max(rss) / 1024, 1),
        )
        result["ok"] = flushed and not result["failures"]
        return result
    finally:
        stop.set()
        for p in pubs:
            p.stop()
            p.close()
        for s in storers:
            s.stop()
        daemon.stop()
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)


def check(daemon: DaemonProcess, pubs: list[SyntheticPublisher], storers: list[SyntheticStorer]) -> dict[str, Any]:
    failures: list[str] = []
    with OffloadClient(daemon.target, timeout_s=60) as client:
        state, offsets = CacheState(), []
        by_source: dict[str, list[tuple[int, int]]] = {}
        evicted: set[int] = set()
        for record in client.subscribe(1):
            state.apply(record)
            offsets.append(record.offset)
            by_source.setdefault(record.source, []).append((record.incarnation, record.source_seq))
            if record.source == "offloadd":
                evicted.update(h for e in record.events if isinstance(e, BlockRemoved) for h in e.block_hashes)
        if offsets != list(range(1, len(offsets) + 1)):
            failures.append("log offsets not contiguous")
        if state != CacheState.from_snapshot(client.snapshot()):
            failures.append("reducer over the log != daemon Snapshot")
        if state.violations:
            failures.append(f"{len(state.violations)} reducer violations, first {state.violations[0]}")
        for p in pubs:
            got = by_source.get(p.engine_id, [])
            if got != [(p.stream.incarnation, q) for q in range(1, p.submitted + 1)]:
                failures.append(f"{p.engine_id}: log has {len(got)} batches, sent {p.submitted}")
            if p.stream.num_dropped or p.stream.num_resets:
                failures.append(f"{p.engine_id}: {p.stream.num_dropped} dropped, {p.stream.num_resets} resets")
            if state.view().get((p.engine_id, "GPU", 0), frozenset()) != p.view():
                failures.append(f"{p.engine_id}: GPU tier in the log != what it holds")
        cpu = state.view().get(("offloadd", "CPU", 0), frozenset())
        arena = client.register_engine("load-checker", 1, "synthetic", [GROUP]).map_arena(0)
        served_total = 0
        for s in storers:
            missing = [h for h in s.stats.committed if to_wire(h) not in cpu and to_wire(h) not in evicted]
            if missing:
                failures.append(f"{s.engine_id}: {len(missing)} committed blocks neither stored nor evicted")
            served, bad = served_blocks_match(client, "load-checker", arena, sorted(s.stats.committed))
            served_total += served
            if bad:
                failures.append(f"{s.engine_id}: {len(bad)} blocks served with wrong bytes")
        arena.close()
        stats = client.stats()
    return {"failures": failures, "log_records": len(offsets), "cpu_blocks": len(cpu),
            "served_checked": served_total, "evictions": stats.evictions}


def table(r: dict[str, Any]) -> str:
    q = ("p50", "p90", "p99", "max")
    lines = [
        f"{r['engines']} synthetic engines, {r['seconds']} s on loopback ({platform.machine()}, "
        f"{os.cpu_count()} cores), slots of {SLOT} B; result: **{'PASS' if r['ok'] else 'FAIL'}**",
        "",
        "| metric | value |",
        "|---|---|",
        f"| event batches sent / in the log exactly once | {r['batches']} / {r['batches'] if r['ok'] else 'see failures'} |",
        f"| event batches per s (all engines) | {r['events_per_s']} |",
        f"| blocks committed (Reserve+write+Commit) | {r['blocks_committed']} ({r['blocks_per_s']}/s, {r['store_mib_per_s']} MiB/s) |",
        f"| evictions (LRU, arena bounded) | {r['evictions']} |",
        f"| blocks served and byte-checked at the end | {r['served_checked']} |",
        f"| log records | {r['log_records']} |",
        "| ingest submit->ack latency ms " + "/".join(q) + " | "
        + " / ".join(str(v) for v in r["ack_ms"].values()) + " |",
        "| store chain of 8 latency ms " + "/".join(q) + " | "
        + " / ".join(str(v) for v in r["store_ms"].values()) + " |",
        "| daemon RSS MiB at 1 s / at 25% of the run / end / max | "
        f"{r['rss_start_mib']} / {r['rss_quarter_mib']} / {r['rss_end_mib']} / {r['rss_max_mib']} |",
        f"| pacing per engine: pause between batches / between chains | {r['pub_pause_ms']} ms / {r['store_pause_ms']} ms |",
        f"| failures | {'; '.join(r['failures']) or 'none'} |",
        "",
        "Daemon RSS per second (MiB): " + " ".join(str(round(k / 1024)) for k in r["rss_kb"]),
    ]
    return "\n".join(lines)


def write_section(text: str) -> None:
    path = REPO / "docs" / "RELIABILITY.md"
    doc = path.read_text() if path.exists() else "# Reliability\n"
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in doc and END in doc:
        doc = doc[: doc.index(BEGIN)] + block + doc[doc.index(END) + len(END):]
    else:
        doc = doc.rstrip("\n") + "\n\n## Load\n\n" + block + "\n"
    path.write_text(doc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--pub-pause-ms", type=float, default=8.0, help="pause between batches per engine")
    ap.add_argument("--store-pause-ms", type=float, default=16.0, help="pause between chains per engine")
    ap.add_argument("--capacity-slots", type=int, default=16384)
    ap.add_argument("--max-resident", type=int, default=2000)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.seconds <= 0 or args.engines < 1:
        print("bench_load: --seconds must be > 0 and --engines >= 1", file=sys.stderr)
        return 2
    result = run(args.seconds, args.engines, args.pub_pause_ms / 1e3, args.store_pause_ms / 1e3,
                 args.capacity_slots, args.max_resident)
    text = table(result)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    if not args.no_write:
        write_section(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
