"""What an engine's GPU tier will hold when a request routed now is admitted, beyond the
router's view: the view is the engine's events as of a moment ago (engine -> offloadd -> log ->
bridge -> router), while this router's own requests on the engine keep allocating blocks.

Per engine, from this router's requests (issue 20, lever b; DECISIONS 54):

- **pending**: a request on the engine whose allocations the view has not shown yet (its last
  full prompt block is not in the engine's GPU tier of the view). Its ``demand`` is the blocks
  it computes that the view does not show yet (its full prompt blocks after the predicted
  cached ones): each takes a block from the engine's pool, evicting the least recently used
  cached one once no free block is left. The engine publishes a step's evictions before the
  blocks it stores, so a block in the view comes with the eviction it caused; a request is
  caught up once its last block was stored in the stream (``saw_stored``, from the follower),
  even if the view no longer shows it (evicted again since).
- **released**: the prompt blocks of this router's finished requests, in the engine's LRU
  order (a request frees its tail blocks first), oldest first. Blocks the router never saw used
  count as older than these; the blocks of requests in flight are in use, never evicted.
- **overlay**: the prompt blocks of a request whose first token came (or that finished) are
  cached on the engine even before their events reach the view; the prediction counts them
  (for a few seconds at most after the request ended).

``surviving`` turns the view's GPU prefix run into the run expected at admission: the overlay
may lengthen it; the evictions the pending demand still has to cause, taken in LRU order, may
cut it. The engine's pool size comes from its ``/health`` (``gpu_blocks``); without it (another
engine kind) the view is taken as it is.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Container, Sequence, Sized
from dataclasses import dataclass, field
from typing import Protocol

from events.schema import BlockHash

OVERLAY_S = 5.0
"""How long a finished request's blocks count on the engine without their events in the view."""
STORED_MEMORY = 8192
"""Blocks the stream showed the engine storing that are remembered (for the prediction truth)."""
RELEASED_MEMORY = 65_536
"""Released blocks kept in LRU order at most (the oldest go first; a pool holds fewer)."""


class GpuTier(Container[BlockHash], Sized, Protocol):
    """The engine's GPU tier in the view (events.state.TierView)."""


@dataclass
class _Pending:
    hashes: Sequence[BlockHash]
    cached: int
    """Leading blocks predicted in the GPU tier when it was routed: not computed again."""
    finished_at: float | None = None
    prefilled: bool = False
    """Its first token came: every prompt block is computed and cached on the engine."""
    reflected: bool = False


@dataclass
class Pressure:
    pool_blocks: int = 0
    """The engine's GPU pool (its /health ``gpu_blocks``); 0: unknown, the view is used as is."""
    _pending: dict[str, _Pending] = field(default_factory=dict)
    _released: collections.OrderedDict[BlockHash, None] = field(default_factory=collections.OrderedDict)
    _last: dict[BlockHash, _Pending] = field(default_factory=dict)
    """Pending requests by their last block, for ``saw_stored``."""
    _stored: collections.OrderedDict[BlockHash, None] = field(default_factory=collections.OrderedDict)
    """The last STORED_MEMORY blocks the stream showed the engine storing."""

    def saw_stored(self, hashes: Sequence[BlockHash]) -> None:
        """The engine's stream stored these blocks (called on the follower's thread under the
        view's lock: it reads ``_last``, marks requests caught up, and remembers the blocks)."""
        last, stored = self._last, self._stored
        for h in hashes:
            p = last.get(h)
            if p is not None:
                p.reflected = True
            stored[h] = None
            stored.move_to_end(h)
        while len(stored) > STORED_MEMORY:
            stored.popitem(last=False)

    def stored_run(self, gpu: GpuTier, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks in the view or seen stored lately, evicted since or not (call under
        the view's lock): what the engine can have reused, for the prediction truth."""
        stored = self._stored
        n = 0
        while n < len(hashes) and (hashes[n] in gpu or hashes[n] in stored):
            n += 1
        return n

    def started(self, request_id: str, hashes: Sequence[BlockHash], cached_blocks: int) -> None:
        """A request went to the engine with ``cached_blocks`` of its ``hashes`` predicted cached."""
        if hashes:
            p = self._pending[request_id] = _Pending(hashes, min(cached_blocks, len(hashes)))
            self._last[hashes[-1]] = p

    def prefilled(self, request_id: str) -> None:
        """The request's first token came: its prompt blocks are all computed."""
        p = self._pending.get(request_id)
        if p is not None:
            p.prefilled = True

    def finished(self, request_id: str, now: float | None = None) -> None:
        """The request ended: its blocks are released to the engine's LRU queue, tail first."""
        p = self._pending.get(request_id)
        if p is None:
            return
        released = self._released
        for h in reversed(p.hashes):
            released[h] = None
            released.move_to_end(h)
        while len(released) > RELEASED_MEMORY:
            released.popitem(last=False)
        now = time.monotonic() if now is None else now
        p.finished_at = now
        for rid, q in list(self._pending.items()):  # those the view caught up with, or never will
            if q.finished_at is not None and (q.reflected or now - q.finished_at > OVERLAY_S):
                self._drop(rid, q)

    def _drop(self, request_id: str, p: _Pending) -> None:
        del self._pending[request_id]
        if self._last.get(p.hashes[-1]) is p:
            del self._last[p.hashes[-1]]

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def surviving(self, gpu: GpuTier, hashes: Sequence[BlockHash], g: int, now: float | None = None) -> int:
        """The GPU prefix run expected at admission, for a view run of ``g`` blocks."""
        if not self._pending or self.pool_blocks <= 0:
            return g
        now = time.monotonic() if now is None else now
        demand, in_flight, overlay = self._refresh(gpu, now)
        n = len(hashes)
        while g < n and hashes[g] in overlay:
            g += 1
        if g == 0 or demand == 0:
            return g
        in_use = {h for p in self._pending.values() if p.finished_at is None for h in p.hashes}
        # Free blocks first (neither cached nor a running request's partial block), then the LRU.
        evictions = demand - max(0, self.pool_blocks - len(gpu) - in_flight)
        if evictions <= 0:
            return g
        evicted = self._least_recent(gpu, in_use, evictions)
        for i in range(g):
            h = hashes[i]
            if h in evicted or (evicted.all_unknown and h not in self._released and h not in in_use):
                return i
        return g

    def _refresh(self, gpu: GpuTier, now: float) -> tuple[int, int, set[BlockHash]]:
        """Drop what the view has caught up with; (pending demand, requests in flight, overlay)."""
        in_flight = 0
        missing: set[BlockHash] = set()  # a block two requests compute is computed once
        overlay: set[BlockHash] = set()
        for rid, p in list(self._pending.items()):
            if not p.reflected and p.hashes[-1] in gpu:
                p.reflected = True
            if p.finished_at is not None and (p.reflected or now - p.finished_at > OVERLAY_S):
                self._drop(rid, p)
                continue
            if p.finished_at is None:
                in_flight += 1
            if not p.reflected:
                # All of it, also with engines that hold a queued prefix: counting only requests
                # that produced a token (their allocations certainly done) missed whole
                # documents evicted before the arrival (BENCHMARKS routing, 799bc2d).
                missing.update(h for h in p.hashes[p.cached :] if h not in gpu)
                if p.prefilled or p.finished_at is not None:
                    overlay.update(p.hashes)
        return len(missing), in_flight, overlay

    def _least_recent(self, gpu: GpuTier, in_use: set[BlockHash], evictions: int) -> _Evicted:
        """The ``evictions`` least recently used cached blocks: first those never seen used by
        this router (all of them, or as many), then the released ones, oldest first."""
        released = self._released
        for h in [h for h in released if h not in gpu]:  # evicted already, as the view shows
            del released[h]
        unknown = len(gpu) - len(released) - sum(1 for h in in_use if h in gpu and h not in released)
        out = _Evicted()
        if evictions < unknown:
            return out  # only blocks this router never saw used go (which of them: unknown)
        out.all_unknown = True
        left = evictions - max(unknown, 0)
        for h in released:
            if left <= 0:
                break
            if h not in in_use:
                out.add(h)
                left -= 1
        return out


class _Evicted(set[BlockHash]):
    all_unknown: bool = False
    """Every cached block the router never saw used is evicted too."""
