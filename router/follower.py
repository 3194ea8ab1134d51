"""The router's view of the cache: it follows kv-bridge with the subscriber library (snapshot
bootstrap, live stream, gap fill) on a thread of its own, and counts the block-event rate.

Readers take :meth:`reading` (the subscriber's lock) around any use of the state, which the
follower thread replaces on a (re-)bootstrap.

The state is hundreds of thousands of long-lived objects: after each bootstrap and each poll
that applied batches the follower calls events.state_gc.GcPolicy, as kv-bridge does, so no full
collection walks them on a request's path.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from events.codec_vllm import WireBatch
from events.schema import BlockStored
from events.state import CacheState
from events.state_gc import GcPolicy
from events.subscriber import KvEventSubscriber, SubscriberError

log = logging.getLogger("kv-router")

RATE_WINDOW_S = 5.0
FULL_GC_INTERVAL_S = 600.0  # as kv-bridge's default


class Follower:
    def __init__(self, pub: str, replay: str, topic: str, *, retry_s: float = 1.0,
                 replay_timeout_s: float = 10.0, full_gc_interval_s: float = FULL_GC_INTERVAL_S) -> None:
        self.sub = KvEventSubscriber(pub, replay, topic, replay_timeout_s=replay_timeout_s)
        self.gc = GcPolicy(full_gc_interval_s)
        self.sub.on_batch(self._count)
        self.stored_listener: Callable[[str, Sequence[int]], None] | None = None
        """Called with each (source, block hashes) stored on the stream, under the state's lock."""
        self._retry_s = retry_s
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._thread = threading.Thread(target=self._run, name="follower", daemon=True)

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    def wait_ready(self, timeout_s: float) -> bool:
        return self._ready.wait(timeout_s)

    def start(self) -> Follower:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop following. The sockets are the follower thread's: it closes them when it
        returns (a snapshot request may keep it up to the replay timeout), never another."""
        self._stop.set()
        if self._thread.ident is None:  # never started
            self.sub.close()
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the bridge follower is still waiting for an answer; it stops after it")

    @contextlib.contextmanager
    def reading(self) -> Iterator[CacheState | None]:
        """The state under the subscriber's lock; None until the first bootstrap."""
        with self.sub.lock:
            yield self.sub.state if self._ready.is_set() else None

    def event_rate(self) -> float:
        """Block events per second seen on the stream over the last few seconds."""
        now = time.monotonic()
        with self.sub.lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def _count(self, _seq: int, batch: WireBatch) -> None:
        blocks = sum(len(getattr(e, "block_hashes", ())) or 1 for e in batch.events)
        self._recent.append((time.monotonic(), blocks))
        listener = self.stored_listener
        if listener is not None:
            with self.sub.lock:
                for event, source in zip(batch.events, batch.sources, strict=False):
                    if isinstance(event, BlockStored):
                        listener(source or self.sub.default_source, event.block_hashes)

    def _run(self) -> None:
        try:
            self._follow()
        finally:
            self.sub.close()

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                self.sub.bootstrap()
                break
            except SubscriberError as exc:
                log.warning("bridge snapshot failed (%s); retrying in %.1fs", exc, self._retry_s)
                self._stop.wait(self._retry_s)
        else:
            return
        log.info("following the bridge from seq %s", self.sub.next_seq)
        self.gc.after_chunk()
        self._ready.set()
        while not self._stop.is_set():
            try:
                if self.sub.poll(100):
                    self.gc.after_chunk()
            except Exception:  # a bug in decoding must not end the router's view silently
                log.exception("following the bridge failed; re-bootstrapping")
                self._stop.wait(self._retry_s)
                with contextlib.suppress(SubscriberError):
                    self.sub.bootstrap()
