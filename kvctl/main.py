"""The kvctl dispatcher: one argparse subcommand per module listed in ``COMMANDS``.

A command module exposes ``register(subparsers)``, which adds its subparser and sets
``handler=<function(args) -> int>`` with ``set_defaults``. Adding a command is one new module
and one line in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Final

from events.schema import SchemaError
from kvctl import demo as demo_cmd
from kvctl import diff as diff_cmd
from kvctl import hash as hash_cmd
from kvctl import plot as plot_cmd
from kvctl import record as record_cmd
from kvctl import repair as repair_cmd
from kvctl import replay as replay_cmd
from kvctl import stats as stats_cmd
from kvctl import tail as tail_cmd
from kvctl import verify as verify_cmd
from kvctl import web as web_cmd
from kvctl.errors import KvctlError

PROG: Final = "kvctl"

# One line per command module.
COMMANDS: Final[tuple[ModuleType, ...]] = (
    hash_cmd,
    record_cmd,
    replay_cmd,
    diff_cmd,
    verify_cmd,
    repair_cmd,
    stats_cmd,
    tail_cmd,
    plot_cmd,
    web_cmd,
    demo_cmd,
)

__all__ = ["COMMANDS", "KvctlError", "build_parser", "main"]

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Inspect, hash, replay and verify the kvoffload event log."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; user errors print one line and return 2, never a traceback."""
    parser = build_parser()
    # argparse exits 2 with usage on bad flags; a command that passes its options on to another
    # program (demo) sets passthrough=True and gets the ones kvctl does not know.
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    handler: Handler = args.handler
    try:
        return handler(args)
    except (KvctlError, SchemaError, ValueError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
