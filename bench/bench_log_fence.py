"""What the write script's source fence costs (DECISIONS 52): appends with it vs without it.

    python bench/bench_log_fence.py [--groups 100] [--group 64] [--rounds 25] [--out bench/results/log_fence.json]

One writer, as the daemon is: write script calls one after the other on a private redis-server
(loopback, AOF everysec), each appending ``--group`` records from 8 sources (consecutive seqs
per source, 10 single-hash BlockStored per record, the engines' shape), all arguments built
before the clock starts. Baseline, in the same run on the same arguments: the same script with
the fence section cut out. Rounds alternate the two on fresh keys; medians are reported, and
the least disturbed round's time in Redis (the minimum: this machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from events.logkeys import LogKeys
from events.records import encode_record, entry_id
from events.schema import BlockStored, LogRecord
from offloadd.log import projection
from offloadd.log.write_script import WRITE, Ops
from tests.support.redis_proc import RedisProcess

NUM_SOURCES = 8
EVENTS_PER_RECORD = 10
_FENCE_START, _FENCE_END = "-- the source fence", "-- end of the source fence"


def unfenced(script: str) -> str:
    """``script`` without its source fence (the baseline)."""
    start, end = script.index(_FENCE_START), script.index(_FENCE_END)
    return script[:start] + script[end:]


def build_calls(keys: LogKeys, num_groups: int, group: int) -> list[tuple[list[str], list[Any]]]:
    """The (keys, args) of every script call, as MetadataStore._write builds them."""
    calls = []
    offset = 0
    seqs = dict.fromkeys(range(NUM_SOURCES), 0)
    for _ in range(num_groups):
        ops = Ops([keys.head, keys.log, keys.sources, keys.owner])
        records: list[Any] = []
        head = offset
        for r in range(group):
            src = r % NUM_SOURCES
            seqs[src] += 1
            offset += 1
            events = tuple(BlockStored((offset * 16 + e,), None, tuple(range(16)), 16, "GPU")
                           for e in range(EVENTS_PER_RECORD))
            record = LogRecord(offset, f"engine-{src}", 1, seqs[src], 0.0, events)
            records += (entry_id(offset), encode_record(record), record.source,
                        projection.encode((1, seqs[src])))
        calls.append((ops.keys, [head, "", group, offset, *records, *ops.args]))
    return calls


def run_round(client: redis.Redis, sha: str, calls: list[tuple[list[str], list[Any]]]) -> tuple[float, float]:
    """Seconds to make every call (client side), and microseconds Redis spent running the
    script per call (its commandstats: no round trips, less of the machine's noise)."""
    client.config_resetstat()
    t0 = time.perf_counter()
    for keys, args in calls:
        reply = client.evalsha(sha, len(keys), *keys, *args)
        assert reply == [b"ok"], reply
    seconds = time.perf_counter() - t0
    stats: Any = client.info("commandstats")
    return seconds, float(stats["cmdstat_evalsha"]["usec_per_call"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=100, help="script calls per round")
    ap.add_argument("--group", type=int, default=64, help="records per call (the daemon's group max)")
    ap.add_argument("--rounds", type=int, default=25, help="rounds of each script, alternating")
    ap.add_argument("--out", default="bench/results/log_fence.json")
    a = ap.parse_args()
    keys = LogKeys("bench-fence")
    calls = build_calls(keys, a.groups, a.group)
    with tempfile.TemporaryDirectory() as work:
        server = RedisProcess(Path(work) / "redis")
        server.start()
        try:
            client = redis.Redis.from_url(server.url)
            shas = {"fenced": client.script_load(WRITE), "unfenced": client.script_load(unfenced(WRITE))}
            times: dict[str, list[float]] = {name: [] for name in shas}
            usec: dict[str, list[float]] = {name: [] for name in shas}
            for i in range(a.rounds):
                for name, sha in shas.items():
                    client.flushall()
                    seconds, per_call = run_round(client, sha, calls)
                    times[name].append(seconds)
                    usec[name].append(per_call)
                print(f"round {i + 1}: " + ", ".join(
                    f"{n} {times[n][-1]:.2f} s ({usec[n][-1]:.0f} us/call in Redis)" for n in shas),
                    flush=True)
            client.close()
        finally:
            server.stop()
    num_records = a.groups * a.group
    rate = {name: num_records / statistics.median(t) for name, t in times.items()}
    script_us = {name: statistics.median(u) for name, u in usec.items()}
    script_us_min = {name: min(u) for name, u in usec.items()}  # the least disturbed round
    result = {
        "bench": "log_fence", "host": platform.node(), "python": platform.python_version(),
        "num_records": num_records, "group": a.group, "num_sources": NUM_SOURCES,
        "events_per_record": EVENTS_PER_RECORD, "rounds": a.rounds, "seconds": times,
        "records_per_s": rate, "ratio_fenced_vs_unfenced": rate["fenced"] / rate["unfenced"],
        "script_usec_per_call": usec, "script_usec_per_call_median": script_us,
        "script_usec_per_call_min": script_us_min,
        "script_time_ratio_fenced_vs_unfenced": script_us["fenced"] / script_us["unfenced"],
        "script_time_ratio_fenced_vs_unfenced_min": script_us_min["fenced"] / script_us_min["unfenced"],
    }
    print(f"| script | records/s, one writer (median of {a.rounds}) | us in Redis per "
          f"{a.group}-record call (median / min) |")
    print("| --- | --- | --- |")
    for name, r in rate.items():
        print(f"| {name} | {r:,.0f} | {script_us[name]:,.0f} / {script_us_min[name]:,.0f} |")
    print(f"fenced / unfenced: throughput {result['ratio_fenced_vs_unfenced']:.2f}, script time "
          f"{result['script_time_ratio_fenced_vs_unfenced']:.2f} (min: "
          f"{result['script_time_ratio_fenced_vs_unfenced_min']:.2f})")
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
