"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Each step first serves running requests (decodes and unfinished prefill chunks, oldest first),
then admits waiting ones while budget, sequence slots and blocks last. A request that cannot get
blocks preempts the newest running request (its blocks are freed; it recomputes later).
A queued request's cached prefix is held from its arrival (engine.prefix_holds); holds are
dropped, newest first, before any request would wait or be preempted for their blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_connector import OffloadConnector
from engine.kv_manager import KVCacheManager
from engine.prefix_holds import PrefixHolds
from engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start: int
    """Tokens already computed (in cache) before this step."""
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        connector: OffloadConnector,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        hold_prefix: bool = True,
    ) -> None:
        self.kv = kv
        self.connector = connector
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.holds = PrefixHolds(kv, hold_prefix)

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.holds.hold(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, num_new):
                if self.holds.release_newest():
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new))
            budget -= num_new
            i += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            scheduled = self._admit(req, budget)
            if scheduled is None and self.holds.release_all(keep=req.request_id):
                scheduled = self._admit(req, budget)
            if scheduled is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            out.scheduled.append(scheduled)
            budget -= scheduled.num_new_tokens
        return out

    def _admit(self, req: Request, budget: int) -> ScheduledRequest | None:
        bs = self.kv.block_size
        fresh = self.holds.fresh_hit(req.request_id)
        if fresh is None:
            num_hit, digests = self.kv.find_prefix_hit(req)
        else:  # nothing cached came or went since the hold matched: the same hit
            num_hit, digests = fresh, self.kv.prompt_digests(req)
        num_ext = self.connector.lookup(req.request_id, digests, num_hit)
        num_ext = max(0, min(num_ext, len(digests) - num_hit))
        start = (num_hit + num_ext) * bs
        num_new = min(req.num_tokens - start, budget)
        held = self.holds.held(req.request_id)
        loads = self.kv.allocate_for_admission(req, digests, num_hit, num_ext, num_new, held, fresh is not None)
        if loads is None:
            return None
        self.holds.handed_over(req.request_id)  # the admission holds its blocks now
        if num_ext:
            self.connector.load(req.request_id, digests[num_hit : num_hit + num_ext], loads)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit * bs
            req.num_external_cached_tokens = num_ext * bs
        req.num_computed_tokens = start
        req.status = RequestStatus.RUNNING
        return ScheduledRequest(req, start, num_new)

    def _preempt(self, req: Request) -> None:
        self.num_preemptions += 1
        self.connector.request_finished(req.request_id)
        self._requeue(req)

    def readmit(self, req: Request) -> None:
        """Undo this step's admission of ``req`` (its result is being dropped): its blocks go
        back and it is the next to be admitted. Not a preemption: nothing ran to completion."""
        self.running.remove(req)
        self._requeue(req)
        req.num_cached_tokens = -1  # counted again by the admission that holds
        req.num_external_cached_tokens = 0

    def _requeue(self, req: Request) -> None:
        """Blocks freed, nothing computed: ``req`` is the next to be admitted."""
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_hashed_blocks = 0
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Remove a finished or aborted request and release its blocks."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        self.holds.release(req.request_id)
        self.connector.request_finished(req.request_id)
