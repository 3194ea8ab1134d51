"""Run one benchmark alternately in two source trees and keep every run's JSON, with the load.

    python bench/ab_trees.py --before /tmp/before --after . --rounds 3 --out bench/results/x.json \\
        -- bench/bench_pipeline.py --shape c

Each round runs the benchmark in ``--before`` then in ``--after`` (a tree is a checkout, e.g.
``git archive COMMIT | tar -x -C DIR``): the script, the daemon and the bridge it starts all
come from that tree, since our benchmarks start their processes from their own repository.
The benchmark's own ``--out`` is added per run; the output file holds each run's JSON under
``runs[tree]``, the 1-minute load average before each run and the commit of each tree when it
is a git checkout. On a shared machine, only runs that alternate like this compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _commit(tree: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def run_once(tree: Path, bench: list[str], out: Path) -> dict[str, Any]:
    """The benchmark in ``tree``; its JSON (an ``error`` row if it failed)."""
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, *bench, "--out", str(out)], cwd=tree)
    row: dict[str, Any] = {"load_1m": round(load, 2), "wall_s": round(time.monotonic() - t0, 1)}
    if proc.returncode != 0 or not out.exists():
        return {**row, "error": f"exit status {proc.returncode}"}
    return {**row, "result": json.loads(out.read_text())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, type=Path, help="the tree measured first in a round")
    p.add_argument("--after", required=True, type=Path, help="the tree measured second")
    p.add_argument("--rounds", type=int, default=3, help="before/after pairs (default 3)")
    p.add_argument("--out", required=True, type=Path, help="where the runs' JSON goes")
    p.add_argument("bench", nargs=argparse.REMAINDER,
                   help="-- the benchmark script (relative to each tree) and its arguments")
    args = p.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        p.error("name the benchmark after --")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for name, tree in trees.items():
        if not (tree / bench[0]).is_file():
            p.error(f"--{name}: {tree / bench[0]} is not a file")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="ab-trees-") as tmp:
        for r in range(args.rounds):
            for name, tree in trees.items():
                print(f"round {r + 1}/{args.rounds}: {name} ({tree})", file=sys.stderr, flush=True)
                runs[name].append(run_once(tree, bench, Path(tmp) / f"{name}-{r}.json"))
    doc = {"bench": bench, "trees": {n: {"path": str(t), "commit": _commit(t)} for n, t in trees.items()},
           "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
