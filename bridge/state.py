"""The bridge's CacheState, applied behind the publish path.

Publishing a record needs only its seq; the state is needed only to answer snapshot requests.
So records are queued (still encoded) when published and applied when the bridge is idle or
before any snapshot; past ``max_pending`` waiting, each new record is matched by applying the
oldest one. A burst goes out at the publishing rate and the state catches up after it, with the
same total work; a longer one is published at the rate of publishing and applying together,
without a stall. Callers hold the bridge's lock.

On a trimmed log the state starts from a checkpoint (bridge.bootstrap) at offset O: at once
(:meth:`start_from`) when the bridge's position is at or after O, or, when it is before O,
once the records up to O have been applied (:meth:`defer_to`: those are skipped, then the
checkpoint's state is taken); until then the state is not ready (:attr:`is_ready`).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from bridge.metrics import BridgeMetrics
from events.logreader import RawEntry, decode_entry
from events.schema import LogRecord, SchemaError
from events.state import CacheState, Snapshot

log = logging.getLogger("kvbridge")


class LazyState:
    def __init__(self, metrics: BridgeMetrics, max_pending: int = 50_000) -> None:
        self._metrics = metrics
        self._max_pending = max_pending
        self._state = CacheState()
        self._pending: deque[RawEntry | LogRecord] = deque()  # stored, or decoded (publisher)
        self._base: CacheState | None = None  # a checkpoint's state, taken at its offset

    @property
    def is_ready(self) -> bool:
        """False while a deferred checkpoint waits for the records before it."""
        return self._base is None

    @property
    def pending(self) -> int:
        return len(self._pending)

    def reset(self) -> None:
        self._state = CacheState()
        self._pending.clear()
        self._base = None

    def start_from(self, snap: Snapshot) -> None:
        """The state is the checkpoint's (at ``snap.offset``); queued records are dropped.
        SchemaError on an invalid event, and the state is left as it was."""
        state = CacheState.from_snapshot(snap)  # a fresh one is swapped in: no in-place restore
        self._state = state
        self._pending.clear()
        self._base = None

    def defer_to(self, snap: Snapshot) -> None:
        """Start afresh; records up to ``snap.offset`` are skipped and the checkpoint's state is
        taken when the one at its offset (or a later one) is applied."""
        base = CacheState.from_snapshot(snap)  # built now: SchemaError here, not mid-publish
        self.reset()
        self._base = base

    def add(self, entry: RawEntry | LogRecord) -> None:
        """Queue one record: its stored entry, or the record decoded (types only, as
        :meth:`apply_entry` decodes it) by a caller that decoded it anyway."""
        pending = self._pending
        pending.append(entry)
        if len(pending) > self._max_pending:  # the pending gauge is set once per chunk
            self._apply_one(pending.popleft())

    def catch_up(self, limit: int | None = None, budget_s: float | None = None) -> int:
        """Apply up to ``limit`` queued records (all when None), stopping once ``budget_s``
        seconds have gone (after at least one); return how many."""
        pending = self._pending
        n = len(pending) if limit is None else min(limit, len(pending))
        done = 0
        if budget_s is None:
            for _ in range(n):
                self._apply_one(pending.popleft())
            done = n
        else:
            deadline = time.perf_counter() + budget_s
            while done < n:
                self._apply_one(pending.popleft())
                done += 1
                if time.perf_counter() >= deadline:
                    break
        self._metrics.pending.set(len(pending))
        return done

    def _apply_one(self, item: RawEntry | LogRecord) -> None:
        if not isinstance(item, LogRecord):
            self.apply_entry(item)
        elif self._reached(item.offset):
            self.apply(item)

    def _reached(self, offset: int) -> bool:
        """Whether the record at ``offset`` is applied: not while a deferred checkpoint holds
        it (its state is taken at its offset, bridge.bootstrap)."""
        base = self._base
        if base is not None:
            if offset < base.offset:
                return False  # the checkpoint holds it
            self._state, self._base = base, None
            if offset == base.offset:
                return False
        return True

    def apply_entry(self, entry: RawEntry) -> None:
        """Decode and apply one stored record; one that cannot be decoded is counted and
        skipped. Its events are checked by the state as it applies them (events.state_apply:
        an invalid one is a violation, the others apply), as in the daemon's recovery; a
        separate validation pass would double the work (DECISIONS 72)."""
        if not self._reached(entry[0]):
            return
        try:
            record = decode_entry(entry, validate=False)
        except SchemaError as exc:
            self._metrics.violations.inc()
            log.error("%s", exc)
            return
        self.apply(record)

    def apply(self, record: LogRecord) -> None:
        state = self._state
        state.apply(record)
        if state.violations:
            for v in state.violations:
                self._metrics.violations.inc()
                log.warning("log record %d from %s: %s (%s)", v.offset, v.source, v.kind, v.detail)
            del state.violations[:]  # a long-running bridge must not accumulate them

    def sources(self) -> list[str]:
        """Every source the state knows (after applying what is queued)."""
        self.catch_up()
        return self._state.sources()

    def export(self) -> Snapshot:
        self.catch_up()
        return self._state.export()

