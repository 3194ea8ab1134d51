"""The real EventSink: each step's events go to offloadd over EventIngest (IngestStream).

IngestStream numbers batches (incarnation, seq), keeps unacked ones in a bounded queue, resends
them after a reconnect and never blocks ``submit``. This sink adds what the engine needs on
top: a resync request when the stream had to start a new incarnation (the engine's next batch,
its whole cached state, then goes out as the re-announce that opens the new incarnation:
IngestStream.resync), and a watcher that says
in the logs when the daemon goes away or comes back (metrics read the same state).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from events.schema import Event
from offloadd.client import ClientSecurity, IngestStream

log = logging.getLogger(__name__)


class IngestEventSink:
    def __init__(
        self,
        target: str,
        engine_id: str,
        *,
        incarnation: int | None = None,
        max_pending: int = 1024,
        watch_interval_s: float = 0.5,
        security: ClientSecurity | None = None,
    ) -> None:
        self.target = target
        self.max_pending = max_pending
        self._resync = threading.Event()
        self._resyncing = False  # take_resync said True: the next publish is the re-announce
        self.stream = IngestStream(
            target, engine_id, incarnation, max_pending=max_pending, on_reset=self._on_reset,
            credentials=security.credentials if security else None,
            token=security.token if security else None,
        )
        self.num_published = 0
        self.num_publish_errors = 0
        self._stop = threading.Event()
        self._watch_interval_s = watch_interval_s
        self._watcher = threading.Thread(target=self._watch, name="ingest-watch", daemon=True)
        self._watcher.start()

    # -- EventSink --------------------------------------------------------------------------
    def publish(self, events: Sequence[Event]) -> None:
        try:
            if self._resyncing:
                self._resyncing = False
                self.stream.resync(events)
            else:
                self.stream.submit(events)
            self.num_published += 1
        except Exception:  # generation must go on whatever the transport does
            self.num_publish_errors += 1
            log.exception("could not queue %d KV events for offloadd", len(events))

    def take_resync(self) -> bool:
        if self._resync.is_set():
            self._resync.clear()
            # The engine publishes its snapshot next (nothing when it holds nothing: then its
            # next step's events are all there is, and they open the new incarnation).
            self._resyncing = True
            return True
        return False

    def close(self, flush_timeout_s: float = 2.0) -> None:
        if not self.stream.flush(flush_timeout_s):
            log.warning("closing with %d KV event batches not acked by offloadd", self.stream.num_pending)
        self._stop.set()
        self._watcher.join(timeout=2)
        self.stream.close()

    # -- state for logs and metrics ---------------------------------------------------------
    @property
    def is_connected(self) -> bool:
        return self.stream.is_connected

    @property
    def num_pending(self) -> int:
        return self.stream.num_pending

    @property
    def incarnation(self) -> int:
        return self.stream.incarnation

    def _on_reset(self, incarnation: int) -> None:
        log.warning(
            "KV event stream to offloadd restarted as incarnation %d (%s); %d batches dropped so far; "
            "re-announcing the cached blocks", incarnation, self.stream.last_error, self.stream.num_dropped,
        )
        self._resync.set()

    def _watch(self) -> None:
        was: bool | None = None
        while not self._stop.wait(self._watch_interval_s):
            now = self.stream.is_connected
            if now == was:
                continue
            if now:
                log.info("offloadd at %s connected; KV events flowing (%d unacked)", self.target, self.num_pending)
            else:
                log.warning(
                    "offloadd at %s unreachable (%s); still serving, KV events queued: %d of %d unacked",
                    self.target, self.stream.last_error or "not connected yet", self.num_pending, self.max_pending,
                )
            was = now
