"""Engine liveness (DESIGN 3.7): an engine's open EventIngest.Publish streams say it is alive.

- A stream belongs to the engine named by its ``kvd-engine-id`` header (IngestStream sends it, so
  an idle engine that reconnects is known at once) and to every engine whose batches it carries.
- When an engine's last stream ends cleanly (the engine half-closed), it departed: its GPU tier
  is cleared at the next sweep.
- When it breaks (cancelled, connection lost, kill -9), a lease of ``lease_s`` starts; a stream
  of that engine opening before the lease runs out cancels it, else the GPU tier is cleared.
- After a restart every engine with GPU blocks in the log starts on a lease: it reconnects to
  this daemon or is cleared.
- From ``stop()`` on nothing is cleared: a stopping daemon's engines did not depart, they
  reconnect to the next one (which gives them a lease).

Clearing is ``Ingest.clear_departed`` (nothing is logged for an engine without GPU blocks); the
server's sweeper drives ``expire()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from offloadd.log.ingest import Ingest
from offloadd.log.metadata import RedisUnavailable

log = logging.getLogger(__name__)


class Liveness:
    def __init__(self, ingest: Ingest, lease_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ingest = ingest
        self.lease_s = lease_s
        self._clock = clock
        self._num_streams: dict[str, int] = {}  # engine_id -> open Publish streams
        self._deadlines: dict[str, float] = {}  # engine_id -> when its GPU tier is cleared
        self.is_stopping = False
        self.num_cleared = 0

    def lease_all(self, engine_ids: Iterable[str]) -> None:
        """Start a lease for each engine that has no stream open (after recovery)."""
        deadline = self._clock() + self.lease_s
        for engine_id in engine_ids:
            if engine_id not in self._num_streams:
                self._deadlines.setdefault(engine_id, deadline)

    def opened(self, engine_id: str) -> None:
        """A stream of ``engine_id`` is open: it is alive, any lease is cancelled."""
        self._num_streams[engine_id] = self._num_streams.get(engine_id, 0) + 1
        self._deadlines.pop(engine_id, None)

    def closed(self, engine_id: str, is_clean: bool) -> None:
        """A stream of ``engine_id`` ended: cleanly (the engine closed it) or broken."""
        left = self._num_streams.get(engine_id, 0) - 1
        if left > 0:
            self._num_streams[engine_id] = left
            return
        self._num_streams.pop(engine_id, None)
        if self.is_stopping:
            return
        self._deadlines[engine_id] = self._clock() + (0.0 if is_clean else self.lease_s)

    def is_leased(self, engine_id: str) -> bool:
        return engine_id in self._deadlines

    def stop(self) -> None:
        """The daemon stops: clear nobody from now on."""
        self.is_stopping = True
        self._deadlines.clear()

    async def expire(self) -> int:
        """Clear the GPU tier of every engine whose deadline passed with no stream open; returns
        how many clears were logged. Raises RedisUnavailable (the deadline is kept, retried at
        the next call) and LogConflict."""
        now = self._clock()
        due = [e for e, t in self._deadlines.items() if t <= now]
        num_cleared = 0
        for engine_id in due:
            if self.is_stopping or self._deadlines.get(engine_id, now + 1) > now:
                continue  # stopping, or it reconnected meanwhile
            del self._deadlines[engine_id]
            try:
                record = await self.ingest.clear_departed(engine_id)
            except RedisUnavailable:
                if engine_id not in self._num_streams and not self.is_stopping:
                    self._deadlines.setdefault(engine_id, now)
                raise
            if record is not None:
                num_cleared += 1
                log.info("engine departed: GPU tier cleared",
                         extra={"engine_id": engine_id, "log_offset": record.offset})
        self.num_cleared += num_cleared
        return num_cleared
