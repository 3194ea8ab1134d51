"""Run an in-process asyncio benchmark with every event-loop step timed, and name the slow ones.

    python bench/loop_steps.py --over-ms 1.5 -- bench/bench_checkpoint_stall.py --modes loop

A step is one callback of the loop (for a task: from one await to the next). Each step longer
than ``--over-ms`` is grouped by where its task stood when the step ended: the chain of awaits,
outermost first (``function:line``), which names the slice of work that just ran (the code
before that await). Printed at the end: per place, the count, the longest and the median step.
For the stdlib loop only (not uvloop); the benchmark runs in this process, so only benchmarks
whose loop runs here (bench_checkpoint_stall) are seen. Timing costs ~1 us a step.
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.events
import runpy
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


def where(callback: Callable[..., Any]) -> str:
    """The await chain of the task ``callback`` steps (or the callback itself)."""
    task = getattr(callback, "__self__", None)
    if not isinstance(task, asyncio.Task):
        return repr(callback)[:120]
    frames: list[str] = []
    link: Any = task.get_coro()
    while link is not None:
        frame = getattr(link, "cr_frame", None) or getattr(link, "ag_frame", None) or getattr(link, "gi_frame", None)
        if frame is not None:
            frames.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        link = getattr(link, "cr_await", None) or getattr(link, "ag_await", None) or getattr(link, "gi_yieldfrom", None)
    return " > ".join(frames) or repr(task)[:120]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                epilog="example: python bench/loop_steps.py -- bench/bench_checkpoint_stall.py "
                                       "--modes loop --rounds 1")
    p.add_argument("--over-ms", type=float, default=1.5, help="steps longer than this are named")
    p.add_argument("--top", type=int, default=25, help="places printed, by their steps' total time")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- the benchmark script and its arguments")
    args = p.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        p.error("give the benchmark after --")
    over_s = args.over_ms / 1000
    slow: dict[str, list[float]] = defaultdict(list)
    run = asyncio.events.Handle._run

    def timed(self: asyncio.events.Handle) -> None:
        t0 = time.perf_counter()
        run(self)
        took = time.perf_counter() - t0
        if took > over_s:
            slow[where(self._callback)].append(took)  # type: ignore[attr-defined]

    asyncio.events.Handle._run = timed  # type: ignore[method-assign]
    sys.argv = bench
    try:
        runpy.run_path(bench[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            print(f"loop_steps: the benchmark exited with {exc.code}", file=sys.stderr)
    finally:
        asyncio.events.Handle._run = run  # type: ignore[method-assign]
    print(f"steps over {args.over_ms} ms, by place (count, longest ms, median ms, where the task stood after):")
    for place, steps in sorted(slow.items(), key=lambda kv: -sum(kv[1]))[: args.top]:
        steps.sort()
        print(f"{len(steps):6d} {steps[-1] * 1e3:8.2f} {steps[len(steps) // 2] * 1e3:8.2f}  {place}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
