"""``kvctl web``'s random access (kvctl/seek.py) against replaying from the start, in one run.

    python bench/bench_web.py [--records 50000] [--keep-every N] [--queries 100]
                              [--out bench/results/web.json]

A simulated fleet log (tests.support FleetSimulator: four engines, chained stores of 3 blocks,
evictions, both tiers) is built in memory. Measured, each beside its baseline:
- loading: ``SeekableLog`` over the records (the reducer plus the kept exports and the overview)
  against the reducer alone over the same records;
- the state at a random offset: what ``/api/state`` computes (``state_json``: with chains, and
  without them as the page asks first) and the bare ``state_at``, against rebuilding it from
  offset 0 as ``kvctl replay --at`` does;
- the diff of two random offsets (``diff_json``, what ``/api/diff`` computes);
- the resident set the loaded log adds.
HTTP and the browser are left out: they add a constant per request, not one that grows with
the log.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from events.schema import LogRecord
from events.state import CacheState
from kvctl.seek import SeekableLog
from tests.support.bridge_proc import FleetSimulator
from tests.support.synthetic_engine import percentile, rss_kb


def build_log(n: int, seed: int) -> list[LogRecord]:
    sim = FleetSimulator([f"engine-{i}" for i in range(4)], seed=seed, block_size=16)
    return [LogRecord(offset, source, 1, seq, 1_700_000_000.0 + offset / 1000, tuple(events))
            for offset, (source, events, seq) in enumerate(sim.records(n), start=1)]


def timed_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def replay_from_start(records: list[LogRecord], at: int) -> CacheState:
    state = CacheState()
    for r in records:
        if r.offset > at:
            break
        state.apply(r)
    return state


def summary(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(percentile(values, 0.5), 2), "p99_ms": round(percentile(values, 0.99), 2),
            "mean_ms": round(sum(values) / len(values), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=50_000)
    ap.add_argument("--keep-every", type=int, help="fixed interval (default: kvctl web's own rule)")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="bench/results/web.json")
    args = ap.parse_args()
    load_at_start = os.getloadavg()[0]  # the machine is shared: say how busy it was
    records = build_log(args.records, args.seed)
    rss_before = rss_kb(os.getpid())
    bare_ms = min(timed_ms(lambda: replay_from_start(records, args.records)) for _ in range(3))
    holder: list[SeekableLog] = []
    load_ms = timed_ms(lambda: holder.append(SeekableLog(CacheState(), records, args.keep_every)))
    log = holder[0]
    rss_added_mb = (rss_kb(os.getpid()) - rss_before) / 1024
    final = log.state_at(log.last)
    resident = sum(final.counts().values())
    rng = random.Random(args.seed)

    def offsets() -> list[int]:  # fresh ones per measurement: the log keeps its last few states
        return [rng.randint(1, log.last) for _ in range(args.queries)]

    state_json = [timed_ms(partial(log.state_json, at)) for at in offsets()]
    counts_json = [timed_ms(partial(log.state_json, at, None, False)) for at in offsets()]
    state_at = [timed_ms(partial(log.state_at, at)) for at in offsets()]
    # The baseline is slow (a whole replay per query): a tenth of the queries.
    baseline = [timed_ms(partial(replay_from_start, records, at)) for at in offsets()[::10]]
    pairs = [sorted((rng.randint(1, log.last), rng.randint(1, log.last))) for _ in range(args.queries // 2)]
    diffs = [timed_ms(partial(log.diff_json, a, b)) for a, b in pairs]
    results: dict[str, Any] = {
        "machine": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count(),
        "load_average_1m_at_start": round(load_at_start, 2),
        "records": args.records, "keep_every": args.keep_every or "auto",
        "kept_states": log.num_kept, "queries": args.queries,
        "resident_blocks_at_end": resident, "block_events": sum(
            len(getattr(e, "block_hashes", ())) for r in records for e in r.events),
        "load_ms": round(load_ms, 1), "bare_replay_ms": round(bare_ms, 1),
        "load_vs_bare_replay": round(load_ms / bare_ms, 2),
        "rss_added_mb": round(rss_added_mb, 1),
        "state_json": summary(state_json), "state_json_without_chains": summary(counts_json),
        "state_at": summary(state_at),
        "replay_from_start": summary(baseline), "diff_json": summary(diffs),
    }
    for name in ("state_at", "state_json_without_chains", "state_json"):  # >1: faster than replay
        results[f"replay_from_start_over_{name}_p50"] = round(
            results["replay_from_start"]["p50_ms"] / results[name]["p50_ms"], 2)
    print(f"log: {args.records} records, {results['block_events']} block events, "
          f"{resident} blocks resident at the end; {log.num_kept} states kept "
          f"(keep every {args.keep_every or 'auto'})")
    print(f"load {load_ms:.0f} ms vs bare replay {bare_ms:.0f} ms "
          f"({results['load_vs_bare_replay']}x); RSS +{rss_added_mb:.0f} MB")
    for name in ("state_json", "state_json_without_chains", "state_at", "replay_from_start",
                 "diff_json"):
        r = results[name]
        print(f"{name:26s} p50 {r['p50_ms']:8.1f} ms  p99 {r['p99_ms']:8.1f} ms  mean {r['mean_ms']:8.1f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
