"""The step's stores: the blocks that became full, snapshotted and made into worker jobs.

``prepare`` runs right after the step was enqueued: one gather per group, stream-ordered after
the step's compute (so the GPU blocks may be reused right after), grouped into offloaded blocks
by engine.offload.store. The blocks of a request whose load from the engine's view is not
checked yet are held apart; ``settle`` lets them go once the check passed, or drops them (the
step's result for that request is dropped too: DECISIONS 21). The jobs are returned, not
submitted: the connector hands them to the worker once the step's outputs are made.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv_cache import KVCacheGroup
from engine.kv_connector import NewBlocks
from engine.offload.config import OffloadConnectorConfig
from engine.offload.metrics import OffloadMetrics
from engine.offload.store import StoreBatcher
from engine.offload.tier import HostTier
from engine.offload.worker import StoreJob


class StoreQueue:
    """Turns each step's new blocks into store jobs, within ``max_pending_store_bytes``."""

    def __init__(self, config: OffloadConnectorConfig, tier: HostTier, metrics: OffloadMetrics) -> None:
        self.config = config
        self.tier = tier
        self.metrics = metrics
        self.batcher = StoreBatcher(tier.k)
        self._held: dict[str, list[StoreJob]] = {}
        """Stores of requests whose load is not checked yet, by request."""

    def prepare(self, new_blocks: Sequence[NewBlocks], skip: set[bytes], unconfirmed: set[str]) -> list[StoreJob]:
        """The step's store jobs for ``new_blocks`` (those with a digest in ``skip`` were
        loaded, not computed: no need to store them). The blocks of ``unconfirmed`` requests
        are held until :meth:`settle`."""
        if not new_blocks or not self.config.store or not self.tier.is_active():
            return []
        by_group: dict[tuple[int, str], list[NewBlocks]] = {}
        for nb in new_blocks:
            key = nb.request_id if nb.request_id in unconfirmed else ""
            by_group.setdefault((nb.group_idx, key), []).append(nb)
        groups = {g.spec.group_idx: g for g in self.tier.groups}
        ready: list[StoreJob] = []
        for (gi, key), batch in by_group.items():
            # Held by request even when nothing is stored now: a redo must drop what the
            # batcher keeps of its incomplete offloaded blocks.
            into = self._held.setdefault(key, []) if key else ready
            job = self._job(groups[gi], batch, skip)
            if job is not None:
                into.append(job)
        return ready

    def _job(self, group: KVCacheGroup, batch: list[NewBlocks], skip: set[bytes]) -> StoreJob | None:
        arena = self.tier.arenas[group.spec.group_idx]
        limit = self.config.max_pending_store_bytes
        if self.metrics.counters.pending_store_bytes > limit:
            self.metrics.add(stores_dropped=1)
            return None
        out = self.batcher.batch(group, arena, batch, skip)
        if out is None:
            return None
        nbytes = out.staging.nbytes
        if self.metrics.counters.pending_store_bytes + nbytes > limit:
            self.metrics.add(stores_dropped=1)
            return None
        ready = None
        if out.staging.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        self.metrics.add(pending_store_bytes=nbytes)
        return StoreJob(group.spec.group_idx, arena, out.staging, ready, out.blocks, self.tier.k)

    def settle(self, redo: set[str]) -> list[StoreJob]:
        """Once the loads were checked: the held jobs of every request not in ``redo``; those
        of ``redo`` are dropped (what the step computed for them is wrong)."""
        held, self._held = self._held, {}
        ready: list[StoreJob] = []
        for request_id, jobs in held.items():
            if request_id not in redo:
                ready.extend(jobs)
                continue
            self.batcher.drop(request_id)
            for job in jobs:
                self.metrics.add(pending_store_bytes=-job.staging.nbytes)
        return ready

    def request_finished(self, request_id: str) -> None:
        """The request left: its incomplete offloaded blocks will never complete."""
        self.batcher.drop(request_id)
