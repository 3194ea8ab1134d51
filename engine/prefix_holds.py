"""Prefix holds: a queued request's cached prefix is protected from eviction from its arrival
until its admission.

Prefix-cache hits are matched at admission, as in vLLM's scheduler. A block that was cached when
the request arrived can be evicted by other requests' allocations while it waits (for the next
step boundary, or behind other requests); the request then recomputes it, and a router that
predicted the hit from the engine's events sees its prediction fail (issue 20's
``eviction_race``). A hold takes a reference on the request's hit blocks when it is queued, as a
scheduler that matches at enqueue would; the admission takes the hold's references over (those
that are its hits; any others are released), so nothing of it is ever counted twice.

Holds are soft: they never keep a request waiting nor get a running one preempted. When the
admission of the head of the queue, or the growth of a running request, runs short of blocks,
the holds of the newest waiting requests go first (docs/DECISIONS.md 54).
"""

from __future__ import annotations

from engine.kv_manager import KVCacheManager
from engine.request import Request


class PrefixHolds:
    def __init__(self, kv: KVCacheManager, enabled: bool = True) -> None:
        self.kv = kv
        self.enabled = enabled and kv.enable_prefix_caching
        self._held: dict[str, list[list[int]]] = {}
        """Per waiting request with a hold, its held blocks per group; oldest first."""
        self._matched: dict[str, tuple[int, int]] = {}
        """Per hold, the KV manager's ``version`` when it was matched and its hit in blocks."""
        self.num_held = 0
        """Requests that got a hold (since start)."""
        self.num_dropped = 0
        """Holds dropped for other requests' blocks before their admission (since start)."""

    def hold(self, req: Request) -> int:
        """Hold the cached prefix of a request being queued; returns how many blocks."""
        if not self.enabled or req.request_id in self._held:
            return 0
        num_hit, digests = self.kv.find_prefix_hit(req)
        if num_hit:
            self._held[req.request_id] = self.kv.hold_blocks(digests, num_hit)
            self._matched[req.request_id] = (self.kv.version, num_hit)
            self.num_held += 1
        return num_hit

    def held(self, request_id: str) -> list[list[int]] | None:
        """The blocks held for a request, per group (None: no hold), for its admission."""
        return self._held.get(request_id)

    def fresh_hit(self, request_id: str) -> int | None:
        """The hold's hit in blocks when no cached block came or went since it was matched (the
        admission's match would find the same blocks; a request that arrived and is admitted in
        the same step is the common case); else None."""
        matched = self._matched.get(request_id)
        return matched[1] if matched is not None and matched[0] == self.kv.version else None

    def handed_over(self, request_id: str) -> None:
        """Forget a request's hold whose references its admission took over
        (``KVCacheManager.allocate_for_admission``): nothing is released here."""
        self._held.pop(request_id, None)
        self._matched.pop(request_id, None)

    def release(self, request_id: str) -> bool:
        """Drop a request's hold (admitted, finished or aborted); False when it had none."""
        self._matched.pop(request_id, None)
        table = self._held.pop(request_id, None)
        if table is None:
            return False
        self.kv.release_blocks(table)
        return True

    def release_newest(self, keep: str | None = None) -> bool:
        """Drop the hold of the most recently queued request other than ``keep``."""
        for rid in reversed(self._held):
            if rid != keep:
                self.num_dropped += 1
                return self.release(rid)
        return False

    def release_all(self, keep: str | None = None) -> bool:
        """Drop every hold but ``keep``'s; False when there was none to drop."""
        dropped = False
        while self.release_newest(keep):
            dropped = True
        return dropped

    @property
    def num_requests(self) -> int:
        return len(self._held)

    @property
    def num_blocks(self) -> int:
        """Block references held, over every group."""
        return sum(len(ids) for table in self._held.values() for ids in table)
