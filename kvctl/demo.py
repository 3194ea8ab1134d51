"""``kvctl demo``: run the demo workload on a local stack (it is ``kv-stack demo``).

The stack and its demo drive gRPC engines, which this package must not import (events stays
free of grpc and torch), so kvctl runs the launcher as a child process and passes its flags on.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from typing import Any

from kvctl.errors import KvctlError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="start a local stack (two engines behind kv-router), run the demo workload through "
        "the router, print hits/misses with TTFT, stop",
        description="Start redis (unless --redis-url/REDIS_URL), offloadd, kv-bridge, two engines "
        "(--engines N) and kv-router in front of them as local processes; send documents and chats "
        "that share prefixes through the router (each request to the engine it chooses, printed "
        "with the reason); print GPU hits, CPU-tier hits and misses with time to first token and "
        "how often the router predicted the cached prefix; write a PNG timeline; then stop "
        "everything. Options are kv-stack's (e.g. --short, --run-dir DIR, --engines N, --policy "
        "kv|round-robin|least-loaded|random, --hybrid, --gpu-blocks N); `kv-stack --help` lists "
        "them all.",
    )
    p.set_defaults(handler=run, passthrough=True)


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("stack") is None or importlib.util.find_spec("engine") is None:
        raise KvctlError("the demo needs the engine: install kvoffload with its 'engine' extra")
    return subprocess.call([sys.executable, "-m", "stack", "demo", *args.extra])
