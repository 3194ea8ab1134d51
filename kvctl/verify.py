"""``kvctl verify``: replay the whole log and check its invariants; exit 1 with a report.

On a Redis log every stream entry is read, not only those up to the head key: an entry that is
not a record (appended by hand, another tool) is reported by its entry ID and skipped, and a
head key that disagrees with the last record is reported too (``kvctl repair`` fixes both). A
log trimmed behind a checkpoint is verified from the oldest usable checkpoint (its state, then
the records after it; kvctl.logsource.open_log) and the report says so; a trimmed log that no
checkpoint covers is reported as ``trimmed``. With ``--archive`` the archive and the live log
are verified as one timeline; offsets in neither are reported as ``missing``."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

from events.logreader import LogUnavailable, decode_stored
from events.records import offset_of
from events.schema import LogRecord, SchemaError
from events.state import CacheState, Violation
from kvctl.errors import KvctlError
from kvctl.logsource import add_source_args, is_redis, log_client, log_keys, log_reader, open_log

EXPLAIN = {
    "log_gap": "log offsets are not contiguous",
    "source_gap": "a source's batch seq skipped (lost batches)",
    "stale_incarnation": "a batch from an older incarnation of a source",
    "unknown_block_removed": "BlockRemoved of a block that was not resident",
    "orphan_child": "GPU BlockStored whose parent block is not resident",
    "invalid_event": "an event that breaks the schema",
    "undecodable": "a log entry that cannot be decoded",
    "trimmed": "the log does not start at offset 1 and no checkpoint covers what is missing",
    "missing": "offsets in neither the archive nor the live log (trimmed before archived)",
    "head_mismatch": "the head key does not name the last record",
}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "verify",
        help="check the log's invariants (exit 1 and a report when any is broken)",
        description="Replay every record through the reducer and report each broken invariant: "
        + "; ".join(f"{k}: {v}" for k, v in EXPLAIN.items()) + ".",
    )
    add_source_args(p)
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.add_argument("--limit", type=int, default=20, help="problems listed per kind (default 20)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    problems: list[Violation] = []
    live = None
    if is_redis(args.log):
        def live(after: int, _until: int) -> Iterator[LogRecord]:
            return _redis_records(args, problems, after)
    view = open_log(args, label="verify", earliest=True, live=live, lenient=True)
    state = view.state()
    first: int | None = None
    records = 0
    try:
        for record in view.records:
            if first is None:
                first = record.offset
                if first != view.start.offset + 1:
                    problems.append(Violation(first, record.source, "trimmed", f"first offset {first}"))
            state.apply(record)
            records += 1
    except SchemaError as exc:
        problems.append(Violation(state.offset + 1, "?", "undecodable", str(exc)))
    problems.extend(state.violations)
    problems.extend(Violation(lo, "?", "missing", f"offsets {lo}..{hi}") for lo, hi in view.gaps)
    problems.sort(key=lambda v: v.offset)
    if args.json:
        report = _report_json(records, state, problems)
        if view.base is not None:
            report["from_checkpoint"] = view.start.offset
        print(json.dumps(report, indent=1))
    else:
        print(_report_text(records, state, problems, args.limit) + (f" ({view.note})" if view.note else ""))
    return 1 if problems else 0


def _redis_records(
    args: argparse.Namespace, problems: list[Violation], after: int = 0,
) -> Iterator[LogRecord]:
    """Every record of the Redis log after offset ``after`` (those before are decoded, to
    check them, not applied); entries that are not records and a wrong head key are appended
    to ``problems`` instead."""
    import redis  # lazy: only the Redis source needs it

    keys = log_keys(args.namespace)
    client = log_client(args.log)
    reader = log_reader(client, keys)
    last = 0
    try:
        for eid, fields in reader.iter_entries():
            try:
                record = decode_stored(eid, fields)
            except SchemaError as exc:
                problems.append(Violation(_offset(eid, last + 1), "?", "undecodable", str(exc)))
                continue
            last = record.offset
            if record.offset > after:
                yield record
        head = client.get(keys.head)
    except LogUnavailable as exc:
        raise KvctlError(f"cannot read the log at {args.log}: {exc}") from None
    except redis.ResponseError as exc:
        raise KvctlError(f"cannot read the log at {args.log}: {exc}") from None
    finally:
        client.close()
    if head is not None and head != str(last).encode():
        problems.append(Violation(last, "?", "head_mismatch",
                                  f"head key {keys.head} is {head[:40]!r}, last record {last}"))


def _offset(eid: bytes, default: int) -> int:
    try:
        return offset_of(eid)
    except ValueError:
        return default


def _report_json(records: int, state: CacheState, problems: list[Violation]) -> dict[str, Any]:
    return {
        "ok": not problems,
        "records": records,
        "last_offset": state.offset,
        "sources": state.sources(),
        "problems": [
            {"offset": v.offset, "source": v.source, "kind": v.kind, "detail": v.detail}
            for v in problems
        ],
    }


def _report_text(records: int, state: CacheState, problems: list[Violation], limit: int) -> str:
    summary = f"{records} records, last offset {state.offset}, {len(state.sources())} sources"
    if not problems:
        return f"verify: OK: {summary}"
    kinds = Counter(v.kind for v in problems)
    lines = [f"verify: FAILED: {len(problems)} problems in {summary}"]
    for kind, n in sorted(kinds.items()):
        lines.append(f"{kind} ({EXPLAIN.get(kind, kind)}): {n}")
        listed = [v for v in problems if v.kind == kind][:limit]
        lines.extend(f"  offset {v.offset} source {v.source}: {v.detail}" for v in listed)
        if n > len(listed):
            lines.append(f"  ... and {n - len(listed)} more")
    return "\n".join(lines)
