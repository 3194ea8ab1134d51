"""Cancelling the daemon's background tasks so that they really end.

On Python 3.11, ``asyncio.wait_for`` returns the inner result when the task awaiting it is
cancelled just as the inner one finishes, and the cancellation is lost (CPython gh-86296; 3.12
rewrote ``wait_for``). redis-py's asyncio connection sends every command through ``wait_for``
when a socket timeout is set (the daemon's ``--redis-timeout-s``), so a task cancelled while it
sends a command goes on as if nothing happened: in a loop of cluster commands, 169 of 300
cancels were lost (DECISIONS 56). A daemon stopping after the log was ended waited forever for
its sweeper that way. :func:`cancel_and_wait` cancels again until the task has ended.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


async def cancel_and_wait(task: asyncio.Task[Any], timeout_s: float = 5.0, retry_s: float = 0.05) -> bool:
    """Cancel ``task`` (again every ``retry_s`` while it goes on) until it ends; False when it
    still runs after ``timeout_s`` (logged with its stack). An error it ended with is logged."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not task.done():
        left = deadline - loop.time()
        if left <= 0:
            log.error("task %s did not end within %.1f s of being cancelled", task.get_name(), timeout_s)
            task.print_stack()
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=min(retry_s, left))
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("task %s ended with an error", task.get_name(), exc_info=exc)
    return True
