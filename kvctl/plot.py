"""``kvctl plot``: a PNG of resident blocks per tier and events/s over the log's time span."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

from events.schema import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored
from kvctl.args import seconds
from kvctl.errors import KvctlError
from kvctl.logsource import add_source_args, open_log


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plot",
        help="PNG of blocks per tier and events/s over time",
        description="Replay the log and plot the resident blocks of each tier (all sources and "
        "groups summed) and the event rate per time bin.",
    )
    add_source_args(p)
    p.add_argument("--out", "-o", required=True, metavar="PNG")
    p.add_argument("--bin-s", type=seconds, default=1.0, help="event-rate bin width (seconds)")
    p.add_argument("--title", default="kvoffload cache state")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display; must precede pyplot
        import matplotlib.pyplot as plt
    except ImportError:
        raise KvctlError("kvctl plot needs matplotlib: pip install 'kvoffload[plot]'") from None
    view = open_log(args, label="plot", earliest=True)
    state = view.state()
    times: list[float] = []
    tiers: dict[str, list[int]] = {m: [] for m in MEDIA}
    totals: Counter[str] = Counter()
    rate: Counter[int] = Counter()
    t0: float | None = None
    for record in view.records:
        t0 = record.ts if t0 is None else t0
        state.apply(record)
        for e in record.events:
            if isinstance(e, BlockStored | BlockRemoved | AllBlocksCleared):
                rate[int((record.ts - t0) // args.bin_s)] += 1
        totals.clear()
        for (_s, medium, _g), n in state.counts().items():
            totals[medium] += n
        times.append(record.ts - t0)
        for m in MEDIA:
            tiers[m].append(totals[m])
    if not times:
        raise KvctlError("the log is empty: nothing to plot")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for m in MEDIA:
        top.step(times, tiers[m], where="post", label=f"{m} tier")
    top.set_ylabel("resident blocks")
    top.legend(loc="upper left")
    top.set_title(args.title)
    bins = sorted(rate)
    bottom.bar([b * args.bin_s for b in bins], [rate[b] / args.bin_s for b in bins],
               width=args.bin_s, align="edge")
    bottom.set_ylabel("events/s")
    bottom.set_xlabel("seconds since the first record")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    plt.close(fig)
    print(f"kvctl: wrote {args.out} ({len(times)} records)", file=sys.stderr)
    return 0
