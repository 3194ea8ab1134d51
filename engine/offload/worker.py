"""The connector's background thread: Reserve -> copy -> Commit for stores, lease releases, and
the Lookups that tell the daemon of hits loaded without asking.

The engine thread only snapshots new blocks (one gather per group per step, in stream order)
and queues a job; everything that waits (RPCs, the device->host copy, its completion) happens
here, so a step never waits for the host tier. On CUDA the copy runs on a side stream that first
waits for the step's gather event; the blocks are committed once the copy's event completed.
A daemon failure aborts the reservation, is logged and counted, and generation goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.offload.copies import ArenaBlocks
from engine.offload.metrics import OffloadMetrics
from offloadd.client import (
    BlockToStore,
    GroupQuery,
    LookupOutcome,
    NotRegistered,
    OffloadClient,
    OffloadClientError,
    ReserveStatus,
)

log = logging.getLogger(__name__)


@dataclass
class StoreJob:
    group_idx: int
    arena: ArenaBlocks
    staging: Tensor
    """Snapshot of the blocks, row i = blocks[i]."""
    ready: torch.cuda.Event | None
    """Recorded after the gather on the compute stream (CUDA only)."""
    blocks: list[BlockToStore]
    multiple: int = 1
    """Engine blocks per offloaded block: block i is staging rows [i*k, i*k+k)."""


@dataclass
class ReleaseJob:
    lease_id: str
    done: torch.cuda.Event | None
    """The load's copies completed once this event did (CUDA only): the slots may go then."""
    timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    """Around the load's copies: its copy time is counted once they completed."""


@dataclass
class TouchJob:
    """A hit loaded without asking: a Lookup without a pin tells the daemon (its LRU order, its
    hit counters), and its answer refreshes the engine's view."""

    queries: list[GroupQuery]


Job = StoreJob | ReleaseJob | TouchJob


class OffloadWorker:
    def __init__(
        self, client: OffloadClient, engine_id: str, lease_ms: int, metrics: OffloadMetrics,
        on_unregistered: Callable[[], None], device: torch.device,
        on_committed: Callable[[int, list[bytes], list[int], list[int]], None] | None = None,
        on_looked_up: Callable[[tuple[bytes, ...], LookupOutcome], None] | None = None,
    ) -> None:
        self.client = client
        self.engine_id = engine_id
        self.lease_ms = lease_ms
        self.metrics = metrics
        self.on_unregistered = on_unregistered
        self.on_committed = on_committed
        """``(group_idx, keys, slots, generations)`` of the blocks each commit made ready."""
        self.on_looked_up = on_looked_up
        """``(keys, answer)`` of each Lookup a TouchJob sent."""
        self.device = device
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._idle = threading.Condition()
        self._outstanding = 0
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, name=f"offload-{engine_id}", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._idle:
            self._outstanding += 1
        self._queue.put(job)

    def wait_idle(self, timeout_s: float) -> bool:
        """Until every queued job is done (tests, benchmarks, shutdown); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        self.wait_idle(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if isinstance(job, StoreJob):
                    self._store(job)
                elif isinstance(job, TouchJob):
                    self._touch(job)
                else:
                    self._release(job)
            except Exception:  # never let one job kill the thread: the engine must go on
                log.exception("offload job failed")
                self.metrics.add(errors=1)
            finally:
                with self._idle:
                    self._outstanding -= 1
                    self._idle.notify_all()

    def _failed(self, what: str, exc: OffloadClientError) -> None:
        log.warning("offload %s failed: %s", what, exc)
        self.metrics.add(errors=1)
        if isinstance(exc, NotRegistered):
            self.on_unregistered()

    def _store(self, job: StoreJob) -> None:
        nbytes = job.staging.nbytes
        try:
            self._reserve_copy_commit(job)
        finally:
            self.metrics.add(pending_store_bytes=-nbytes)

    def _reserve_copy_commit(self, job: StoreJob) -> None:
        try:
            outcome = self.client.reserve(self.engine_id, job.group_idx, job.blocks, self.lease_ms)
        except OffloadClientError as exc:
            self._failed("reserve", exc)
            return
        statuses = [s for s, _ in outcome.blocks]
        self.metrics.add(
            blocks_already_stored=statuses.count(ReserveStatus.ALREADY_STORED),
            blocks_in_flight=statuses.count(ReserveStatus.IN_FLIGHT),
            blocks_no_space=statuses.count(ReserveStatus.NO_SPACE),
        )
        reserved = [i for i, (s, _) in enumerate(outcome.blocks) if s is ReserveStatus.RESERVED]
        if not reserved:
            return
        k = job.multiple
        rows = [i * k + j for i in reserved for j in range(k)]
        slots = [outcome.blocks[i][1] * k + j for i in reserved for j in range(k)]
        try:
            seconds = self._copy(job, rows, slots)
        except Exception:
            log.exception("offload store copy failed; aborting reservation")
            self.metrics.add(errors=1)
            self._abort(outcome.reservation_id)
            return
        try:
            self.client.commit(self.engine_id, outcome.reservation_id)
        except OffloadClientError as exc:
            self._failed("commit", exc)
            self._abort(outcome.reservation_id)
            return
        self.metrics.add(
            blocks_stored=len(reserved), bytes_stored=len(rows) * job.arena.geometry.slot_bytes,
            store_copy_seconds=seconds,
        )
        if self.on_committed is not None and len(outcome.generations) == len(outcome.blocks):
            self.on_committed(job.group_idx, [job.blocks[i].block_hash for i in reserved],
                              [outcome.blocks[i][1] for i in reserved],
                              [outcome.generations[i] for i in reserved])

    def _copy(self, job: StoreJob, rows: list[int], slots: list[int]) -> float:
        """Copy the reserved rows into their slots; returns the copy's own duration in seconds."""
        if self._side is None:
            t0 = time.perf_counter()
            src = job.staging if len(rows) == len(job.staging) else job.staging[rows]
            job.arena.write(src, slots)
            return time.perf_counter() - t0
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._side):
            if job.ready is not None:
                self._side.wait_event(job.ready)
            start.record(self._side)
            src = job.staging if len(rows) == len(job.staging) else job.staging[torch.tensor(rows, device=job.staging.device)]
            job.arena.write(src, slots)
            done.record(self._side)
        done.synchronize()
        return start.elapsed_time(done) / 1000.0

    def _abort(self, reservation_id: str) -> None:
        try:
            self.client.abort(self.engine_id, reservation_id)
        except OffloadClientError as exc:  # the reservation expires on its own
            self._failed("abort", exc)

    def _release(self, job: ReleaseJob) -> None:
        if job.done is not None:
            job.done.synchronize()
        if job.timing is not None:
            start, end = job.timing
            self.metrics.add(load_copy_seconds=start.elapsed_time(end) / 1000.0)
        if not job.lease_id:
            return
        try:
            self.client.release(self.engine_id, job.lease_id)
        except OffloadClientError as exc:  # the lease expires on its own
            self._failed("release", exc)

    def _touch(self, job: TouchJob) -> None:
        try:
            outcome = self.client.lookup(self.engine_id, job.queries, pin=False)
        except OffloadClientError as exc:  # only the daemon's LRU order misses this hit
            self._failed("lookup", exc)
            return
        self.metrics.add(lookups=1)
        if self.on_looked_up is not None:
            self.on_looked_up(job.queries[0].block_hashes, outcome)
