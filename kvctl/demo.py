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
        help="start a local stack, run the demo workload, print hits/misses with TTFT, stop",
        description="Start redis (unless --redis-url/REDIS_URL), offloadd, kv-bridge and an engine "
        "as local processes, run chats and documents that share prefixes through them (a second "
        "engine joins halfway), print GPU hits, CPU-tier hits and misses with time to first token, "
        "write a PNG timeline, then stop everything. Options are kv-stack's (e.g. --short, "
        "--run-dir DIR, --hybrid, --gpu-blocks N).",
    )
    p.set_defaults(handler=run, passthrough=True)


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("stack") is None or importlib.util.find_spec("engine") is None:
        raise KvctlError("the demo needs the engine: install kvoffload with its 'engine' extra")
    return subprocess.call([sys.executable, "-m", "stack", "demo", *args.extra])
