"""Retries of unary gRPC calls on network-class errors only, with exponential backoff.

Only codes that say the request may not have been applied are retried: UNAVAILABLE for every
call, DEADLINE_EXCEEDED too for reads (a timed-out write may have landed, so retrying it is the
caller's decision). Everything else is the server's answer and is raised at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc

T = TypeVar("T")

NETWORK_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
"""Safe to retry for any call: the request did not reach a server that could apply it."""
NETWORK_READ_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Safe to retry for calls that change nothing."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry; ``attempts`` counts the first call too."""

    attempts: int = 4
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    multiplier: float = 2.0

    def delays(self) -> Iterator[float]:
        """The sleeps between attempts: ``attempts - 1`` of them, growing to the cap."""
        delay = self.initial_backoff_s
        for _ in range(self.attempts - 1):
            yield delay
            delay = min(delay * self.multiplier, self.max_backoff_s)


def call_with_retry(
    fn: Callable[[], T], policy: RetryPolicy, retry_on: frozenset[grpc.StatusCode]
) -> T:
    """``fn()``, called again after a backoff while it fails with a code in ``retry_on`` and
    attempts are left. The last ``grpc.RpcError`` propagates unchanged for the caller to map."""
    delays = policy.delays()
    while True:
        try:
            return fn()
        except grpc.RpcError as exc:
            if exc.code() not in retry_on:  # type: ignore[attr-defined]
                raise
            delay = next(delays, None)
            if delay is None:
                raise
            time.sleep(delay)
