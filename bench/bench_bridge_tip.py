"""What kv-bridge's read from its last published record (bridge.tip) costs: the bridge of this
checkout vs the bridge of a checkout before it, alternating in one run, on the same log writer,
payloads and subscriber as bench/bench_bridge.py (whose rows these are).

    git archive <rev-before> bridge | tar -x -C /tmp/before
    python bench/bench_bridge_tip.py --before-root /tmp/before [--repeat 3]
                                     [--out bench/results/bridge_tip.json]

Rows: a trickle (each record arrives alone, after the bridge waited idle: the case that costs
two more round trips), the paced 50k block events/s latency row, and the burst throughput row.
Latency: best p99 and median p50 of ``--repeat`` runs each; throughput: best of the runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_bridge import BLOCK_EVENTS_PER_BATCH, run_bridge

ROWS: dict[str, tuple[int, float | None]] = {  # name: (records, batches/s; None: a burst)
    "trickle_100_per_s": (300, 100.0),
    "paced_50k_block_events_per_s": (9375, 50_000 / BLOCK_EVENTS_PER_BATCH),
    "burst_20000": (20_000, None),
}


def summary(runs: list[dict[str, Any]], paced: bool) -> dict[str, Any]:
    if not paced:
        return {"block_events_per_s": max(r["block_events_per_s"] for r in runs),
                "all": [round(r["block_events_per_s"]) for r in runs],
                "gaps": sum(r["gaps"] for r in runs)}
    return {"p50_ms": statistics.median(r["p50_ms"] for r in runs),
            "p99_ms": min(r["p99_ms"] for r in runs),
            "all_p99_ms": [round(r["p99_ms"], 3) for r in runs],
            "gaps": sum(r["gaps"] for r in runs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--before-root", type=Path, required=True,
                    help="a checkout holding the bridge/ from before the change")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each row and bridge")
    ap.add_argument("--out", default="bench/results/bridge_tip.json")
    args = ap.parse_args()
    before = args.before_root.resolve()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {r: {"after": [], "before": []} for r in ROWS}
    with tempfile.TemporaryDirectory(prefix="bench-bridge-tip-") as tmp:
        work = Path(tmp)
        for i in range(args.repeat):
            for row, (n, rate) in ROWS.items():
                for which in ("after", "before"):
                    print(f"run {i + 1}/{args.repeat}: {row}, {which}", flush=True)
                    runs[row][which].append(
                        run_bridge(work, n, rate, root=before if which == "before" else None))
    results = {row: {w: summary(rs, ROWS[row][1] is not None) for w, rs in by.items()}
               for row, by in runs.items()}
    print(f"host: {platform.node()}; before: {before}")
    for row, by in results.items():
        a, b = by["after"], by["before"]
        if "p99_ms" in a:
            print(f"{row:<30} p50 {b['p50_ms']:.3f} -> {a['p50_ms']:.3f} ms, "
                  f"p99 {b['p99_ms']:.3f} -> {a['p99_ms']:.3f} ms (best; runs {b['all_p99_ms']} / "
                  f"{a['all_p99_ms']}), gaps {b['gaps']}/{a['gaps']}")
        else:
            print(f"{row:<30} {b['block_events_per_s']:,.0f} -> {a['block_events_per_s']:,.0f} "
                  f"block events/s = {a['block_events_per_s'] / b['block_events_per_s']:.2f}x "
                  f"(runs {b['all']} / {a['all']}), gaps {b['gaps']}/{a['gaps']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {"before_root": str(before), "repeat": args.repeat},
                               "host": platform.node(), **results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
