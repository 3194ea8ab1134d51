"""CPU per block event of each process on the event path as a function of the publish pace.

    python bench/bench_paced_cpu.py [--rates 12500,50000,200000,none] [--scale 0.3] [--out ...]

The same batches (shape c: 100 single-block ``BlockStored`` per batch, one stream; ``--scale``
of 10,000 batches) go through the whole path (``bench_pipeline.run_pipeline``: engine stream ->
offloadd -> Redis -> kv-bridge -> ZMQ SUB) once per rate, paced at that many block events/s, or
as fast as the stream goes (``none``). Each row has the CPU seconds per 1M block events of
offloadd, kv-bridge and Redis (from /proc), the rate reached and p50/p99 send -> receive.
A cost per batch that does not depend on the pace gives the same CPU per event at every paced
rate; one that grows with the idle time between batches (wake-ups, cold caches) falls as the
rate rises, in every process alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipeline import run_pipeline, shape_batches


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rates", default="12500,50000,200000,none",
                    help="comma-separated block events/s; 'none' = unpaced")
    ap.add_argument("--scale", type=float, default=0.3, help="fraction of 10,000 batches per run")
    ap.add_argument("--out", default="bench/results/paced_cpu.json")
    args = ap.parse_args()
    try:
        rates = [None if r.strip() == "none" else float(r) for r in args.rates.split(",")]
    except ValueError:
        ap.error(f"--rates: numbers or 'none', got {args.rates!r}")
    if any(r is not None and r <= 0 for r in rates):
        ap.error("--rates: each rate must be > 0")
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-paced-") as tmp:
        streams = shape_batches("c", args.scale)
        for rate in rates:
            row = run_pipeline(Path(tmp), streams, rate)
            cpu = {name: c["cpu_s_per_1m_events"] for name, c in row["cpu"].items()}
            rows["none" if rate is None else str(int(rate))] = {
                "cpu_s_per_1m_events": cpu, "block_events_per_s": row["block_events_per_s"],
                "p50_ms": row.get("p50_ms"), "p99_ms": row.get("p99_ms"), "lost": row["lost"],
            }
            print(f"pace {'none' if rate is None else f'{rate:,.0f}'}: reached "
                  f"{row['block_events_per_s']:,.0f} block ev/s, lost {row['lost']}; CPU per 1M: "
                  + ", ".join(f"{k} {v} s" for k, v in cpu.items()), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"host": platform.node(), "load_1m": os.getloadavg()[0],
                               "args": vars(args), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
