"""``kvctl stats``: counts over the log: records, events by type and tier, sources, rates.

On a trimmed Redis log the counts are of the records after the oldest usable checkpoint and
the resident blocks start from it (kvctl.logsource.open_log; with --archive, archive and live
log are one timeline); the output says so, and names offsets in neither."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

from events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from kvctl.logsource import add_source_args, open_log
from kvctl.replay import fmt_ts


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "stats",
        help="counts of records, events and blocks per source and tier",
        description="Read the whole log once and print how many records and events it holds, "
        "per source and tier, over what time span, and the blocks resident at its end.",
    )
    add_source_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    view = open_log(args, label="stats", earliest=True)
    state = view.state()
    records, events = 0, Counter[str]()
    per_source: Counter[str] = Counter()
    blocks: Counter[tuple[str, str]] = Counter()  # (event type, medium) -> block count
    first_ts: float | None = None
    last_ts: float | None = None
    for record in view.records:
        records += 1
        per_source[record.source] += 1
        first_ts = record.ts if first_ts is None else min(first_ts, record.ts)
        last_ts = record.ts if last_ts is None else max(last_ts, record.ts)
        for e in record.events:
            events[type(e).__name__] += 1
            if isinstance(e, BlockStored | BlockRemoved):
                blocks[(type(e).__name__, e.medium)] += len(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                blocks[("AllBlocksCleared", e.medium or "ALL")] += 1
        state.apply(record)
    span = (last_ts - first_ts) if first_ts is not None and last_ts is not None else 0.0
    out: dict[str, Any] = {
        "records": records,
        "last_offset": state.offset,
        "first_ts": first_ts,
        "last_ts": last_ts,
        "span_s": span,
        "records_per_s": records / span if span > 0 else None,
        "events": dict(sorted(events.items())),
        "block_events": {f"{t} {m}": n for (t, m), n in sorted(blocks.items())},
        "records_per_source": dict(sorted(per_source.items())),
        "resident_blocks": {f"{s} {m} g{g}": n for (s, m, g), n in sorted(state.counts().items())},
        "violations": len(state.violations),
    }
    if view.base is not None:
        out["from_checkpoint"] = view.base.offset
    if view.gaps:
        out["missing"] = [list(g) for g in view.gaps]
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    rate = f"{out['records_per_s']:.1f} records/s" if out["records_per_s"] else "-"
    print(f"records: {records} (last offset {state.offset})" + (f", {view.note}" if view.note else ""))
    print(f"time: {fmt_ts(first_ts)} .. {fmt_ts(last_ts)} ({span:.3f} s, {rate})")
    for title, table in (
        ("events", out["events"]), ("blocks in events", out["block_events"]),
        ("records per source", out["records_per_source"]),
        ("resident at the end", out["resident_blocks"]),
    ):
        print(f"{title}:")
        for key, n in table.items():
            print(f"  {key}: {n}")
        if not table:
            print("  (none)")
    for lo, hi in view.gaps:
        print(f"missing: offsets {lo}..{hi} (in neither the archive nor the live log)")
    print(f"violations: {out['violations']}")
    return 0
