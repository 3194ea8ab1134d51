"""What a daemon's start costs before it serves, with nothing to recover.

    python bench/bench_start.py [--before-tree DIR] [--restarts 8] [--out bench/results/start.json]

An empty daemon on its own Redis is killed and started ``--restarts`` times (alternating with
the daemon of ``--before-tree``, a checkout of another commit, when given): exec -> health
SERVING (probed every 50 ms on a channel that reconnects within 20 ms) and the CPU seconds the
process used by then (user + system, all threads), which a loaded machine inflates far less than
the wall time, and how long its main thread (the event loop) waited for a CPU meanwhile
(``main_runq_s``, /proc/PID/schedstat). Bytecode is compiled once for each tree before the first start, as an installed
package has it. bench_recovery.py measures the same with 100k blocks to restore.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_recovery import in_tree, main_runq_s, process_cpu_s
from tests.support.offloadd_proc import REPO, DaemonProcess
from tests.support.redis_proc import RedisProcess


def run(work: Path, trees: dict[str, str], restarts: int) -> dict[str, list[dict[str, Any]]]:
    redis_proc = RedisProcess(work / "redis")
    redis_proc.start()
    daemon = DaemonProcess(work / "offloadd", redis_proc.url, "default")
    base = list(daemon.args)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    try:
        for i in range(restarts):
            for name, tree in trees.items():
                daemon.kill()
                daemon.args = in_tree(base, tree)
                load = os.getloadavg()[0]
                t0 = time.perf_counter()
                daemon.start()
                wall = time.perf_counter() - t0
                cpu = process_cpu_s(daemon.proc.pid) if daemon.proc else None
                runq = main_runq_s(daemon.proc.pid) if daemon.proc else None
                rows[name].append({"exec_to_serving_s": round(wall, 3), "cpu_to_serving_s": cpu,
                                   "main_runq_s": runq, "load_1m": round(load, 2)})
                print(f"{i + 1}/{restarts} {name}: {wall:.2f} s, CPU {cpu} s, waited for a CPU "
                      f"{runq} s", file=sys.stderr)
    finally:
        daemon.kill()
        redis_proc.stop()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before-tree", default="", help="also start the daemon of this tree, alternating")
    p.add_argument("--restarts", type=int, default=8, help="starts per tree (default 8)")
    p.add_argument("--out", default="bench/results/start.json")
    args = p.parse_args()
    if args.restarts < 1:
        p.error("--restarts must be >= 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the processes it started
    trees = {"before": args.before_tree, "after": str(REPO)} if args.before_tree else {"": str(REPO)}
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp:
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # inherited by the daemons
        os.environ["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        for tree in trees.values():
            subprocess.run([sys.executable, "-c", "import offloadd.__main__"], cwd=tree, check=True)
        rows = run(Path(tmp), trees, args.restarts)
    summary = {name: {"median_exec_to_serving_s": statistics.median(r["exec_to_serving_s"] for r in runs),
                      "median_cpu_to_serving_s": statistics.median(r["cpu_to_serving_s"] or 0.0 for r in runs),
                      "median_main_runq_s": statistics.median(r["main_runq_s"] or 0.0 for r in runs)}
               for name, runs in rows.items()}
    doc = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
           "trees": trees, "summary": summary, "runs": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name or 'daemon'}: exec -> SERVING median {s['median_exec_to_serving_s']:.2f} s, "
              f"CPU {s['median_cpu_to_serving_s']:.2f} s")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
