"""``kvctl diff``: what changed in the cache state between two log offsets."""

from __future__ import annotations

import argparse
import json
from typing import Any

from events.schema import Medium
from events.state import CacheState
from kvctl.errors import KvctlError
from kvctl.logsource import add_source_args
from kvctl.replay import state_at

TierKey = tuple[str, Medium, int]
Changes = dict[TierKey, tuple[list[int], list[int]]]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "diff",
        help="blocks added and removed between offsets A and B",
        description="Rebuild the state at offsets A and B and print, per source, tier and group, "
        "the blocks resident at B but not A (+) and at A but not B (-).",
    )
    add_source_args(p)
    p.add_argument("a", type=int, metavar="A", help="earlier offset (0 = empty state)")
    p.add_argument("b", type=int, metavar="B", help="later offset")
    p.add_argument("--json", action="store_true", help="JSON with every hash")
    p.add_argument("--hashes", action="store_true", help="list the hashes in the table too")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.a > args.b:
        raise KvctlError(f"A ({args.a}) must not be after B ({args.b})")
    before, _ = state_at(args, args.a)
    after, _ = state_at(args, args.b)
    changes = tier_changes(before, after)
    if args.json:
        out: list[dict[str, Any]] = [
            {"source": s, "medium": m, "group_idx": g, "added": a, "removed": r}
            for (s, m, g), (a, r) in changes.items()
        ]
        print(json.dumps({"from": args.a, "to": args.b, "changes": out}, indent=1))
        return 0
    print(f"diff {args.a} -> {args.b}")
    if not changes:
        print("(no change)")
    for (s, m, g), (added, removed) in changes.items():
        print(f"{s} {m} group {g}: +{len(added)} -{len(removed)}")
        if args.hashes:
            for h in added:
                print(f"  + {h}")
            for h in removed:
                print(f"  - {h}")
    return 0


def tier_changes(before: CacheState, after: CacheState) -> Changes:
    """Per tier, the blocks resident after but not before (added) and before but not after
    (removed), sorted; tiers without a change are left out."""
    va, vb = before.view(), after.view()
    changes: Changes = {}
    for key in sorted(va.keys() | vb.keys()):
        old, new = va.get(key, frozenset()), vb.get(key, frozenset())
        added, removed = sorted(new - old), sorted(old - new)
        if added or removed:
            changes[key] = (added, removed)
    return changes
