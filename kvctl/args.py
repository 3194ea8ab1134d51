"""argparse value types shared by kvctl's subcommands: a bad value is a usage line, not a traceback."""

from __future__ import annotations

import argparse
import math


def seconds(text: str) -> float:
    """A duration > 0 and finite: ``nan`` passed a ``<= 0`` check and then broke the arithmetic
    (``int(nan)`` in plot's bins), ``inf`` made a deadline that never comes."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds and finite, got {text!r}")
    return value
