"""Graceful stop for the long-running processes: SIGTERM and SIGINT set one event."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType


def stop_on_signals(log: logging.Logger) -> threading.Event:
    """An event that SIGTERM or SIGINT sets (logged); call from the main thread."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop
