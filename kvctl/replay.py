"""``kvctl replay``: the cache state at an offset or a time, as a table or JSON.

On a trimmed Redis log the state starts from the newest checkpoint at or before the offset asked
for (kvctl.logsource.open_log; with --archive, archive and live log are one timeline) and the
output says so."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import Any

from events.state import CacheState
from kvctl.errors import KvctlError
from kvctl.logsource import add_source_args, open_log


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "replay",
        help="rebuild the cache state at --at OFFSET or --until TIME",
        description="Apply the log's records in order and print the resulting state: resident "
        "blocks per source, tier and KV group. Without --at/--until, the whole log.",
    )
    add_source_args(p)
    when = p.add_mutually_exclusive_group()
    when.add_argument("--at", type=int, metavar="OFFSET", help="state after this log offset")
    when.add_argument(
        "--until", metavar="TIME", help="state after the last record at or before TIME "
        "(epoch seconds or ISO 8601, e.g. 2026-11-30T12:00:00Z)",
    )
    p.add_argument("--source", dest="only_source", metavar="ENGINE", help="show only this source")
    p.add_argument("--json", action="store_true", help="JSON with every block hash")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    until_ts = parse_time(args.until) if args.until else None
    state, ts, note = replayed(args, args.at, until_ts)
    if args.only_source and args.only_source not in state.sources():
        known = ", ".join(state.sources()) or "none"
        raise KvctlError(f"no source {args.only_source!r} at offset {state.offset} (known: {known})")
    if args.json:
        out = state_json(state, ts, args.only_source)
        if note:
            out["from"] = note
        print(json.dumps(out, indent=1))
    else:
        print(state_table(state, ts, args.only_source, note))
    return 0


def state_at(
    args: argparse.Namespace, at: int | None, until_ts: float | None = None
) -> tuple[CacheState, float | None]:
    """The state after offset ``at`` (or the last record at/before ``until_ts``); its ts."""
    state, ts, _note = replayed(args, at, until_ts)
    return state, ts


def replayed(
    args: argparse.Namespace, at: int | None, until_ts: float | None = None
) -> tuple[CacheState, float | None, str]:
    """:func:`state_at` and where the state started ('' at offset 0, else the checkpoint)."""
    if at is not None and at < 0:
        raise KvctlError(f"--at must be >= 0, got {at}")
    view = open_log(args, at, label="replay")
    made = view.start.created_ts
    if until_ts is not None and made is not None and until_ts < made:
        raise KvctlError(f"--until {fmt_ts(until_ts)} is before the {view.start.what} "
                         f"({fmt_ts(made)}) and the log before it was trimmed; replay an archive "
                         "from 'kvctl record --follow' for older states")
    state = view.state()
    last_ts: float | None = None
    for record in view.records:
        if until_ts is not None and record.ts > until_ts:
            break
        state.apply(record)
        last_ts = record.ts
    if at is not None and state.offset < at:
        raise KvctlError(f"offset {at} is beyond the end of the log (last offset {state.offset})")
    return state, last_ts, view.note


def parse_time(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise KvctlError(f"--until: {text!r} is neither epoch seconds nor ISO 8601") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def fmt_ts(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")


def state_json(state: CacheState, ts: float | None, only: str | None = None) -> dict[str, Any]:
    sources: dict[str, Any] = {}
    for source in state.sources():
        if only is not None and source != only:
            continue
        fence = state.fence(source)
        tiers = [
            {"medium": m, "group_idx": g, "blocks": sorted(state.blocks(s, m, g))}
            for (s, m, g) in sorted(state.counts())
            if s == source
        ]
        sources[source] = {"fence": list(fence) if fence else None, "tiers": tiers}
    return {"offset": state.offset, "ts": ts, "sources": sources}


def state_table(state: CacheState, ts: float | None, only: str | None = None, note: str = "") -> str:
    rows = [
        (s, m, str(g), str(n))
        for (s, m, g), n in sorted(state.counts().items())
        if only is None or s == only
    ]
    head = ("SOURCE", "MEDIUM", "GROUP", "BLOCKS")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    lines = [f"state at offset {state.offset} ({fmt_ts(ts)})" + (f", {note}" if note else "")]
    for row in [head, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    if not rows:
        lines.append("(no resident blocks)")
    return "\n".join(lines)
