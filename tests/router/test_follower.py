"""router.follower's sockets belong to its thread: stopping it while a snapshot request waits for
a bridge that does not answer returns at once and leaves the sockets to the thread, which closes
them when the request times out."""

from __future__ import annotations

import time

from router.follower import Follower
from tests.support.redis_proc import free_port


def _nobody() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def test_stop_leaves_the_sockets_to_the_follower_thread() -> None:
    follower = Follower(_nobody(), _nobody(), "t", retry_s=0.05, replay_timeout_s=1.0).start()
    time.sleep(0.2)  # in its first snapshot request, which nothing answers
    started = time.monotonic()
    follower.stop(timeout_s=0.1)
    assert time.monotonic() - started < 0.5
    assert not follower.sub._sub.closed  # still the thread's, in use
    follower._thread.join(3.0)
    assert not follower._thread.is_alive() and follower.sub._sub.closed
    assert not follower.is_ready


def test_a_follower_never_started_is_closed_by_stop() -> None:
    follower = Follower(_nobody(), _nobody(), "t")
    follower.stop()
    assert follower.sub._sub.closed
