"""The offload connector: the engine's side of offloadd's host tier (a second KV tier).

A thin facade over three objects, called in the per-step order of engine.kv_connector:

- :class:`engine.offload.tier.HostTier`: the registration (arenas, generation tables, the
  engine's view of the tier), registered again after the daemon forgot the engine;
- :class:`engine.offload.loads.Loads`: at admission ``lookup`` and ``load`` (from the view
  without any RPC when the generation table vouches for it, else pinned after a Lookup;
  DECISIONS 20-22), issued layer by layer by default (``take_layer_waits``, DECISIONS 18);
  after the step ``finish_loads`` completes them in stream order and ``check_loads`` checks
  the loads from the view before the step's result is used;
- :class:`engine.offload.store_queue.StoreQueue`: ``store`` snapshots the step's new blocks
  (one gather per group) into jobs, holding apart those of requests not checked yet.

Host work keeps this order in a step: the step is launched with no worker awake; after it,
its loads are finished, its new blocks registered and stored, and only then are the loads
from the view checked (the check may wait for their copies; DECISIONS 21); the jobs made
(stores, releases, hit reports) go to :class:`engine.offload.worker.OffloadWorker` in
``step_done``, once the step's outputs are made, so that its thread never shares the GIL with
the step's launch or output. The offloaded block may be a multiple of the engine block
(``block_size_multiple``, engine.offload.store). Any daemon failure is logged and counted and
the engine runs on without the host tier.

Only ``offloadd.client`` is used to reach the daemon (DESIGN.md 5).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from prometheus_client.registry import CollectorRegistry

from engine.kv_cache import KVCacheGroup
from engine.kv_connector import NewBlocks
from engine.offload.config import OffloadConnectorConfig
from engine.offload.layerwise import LayerLoader, LayerLoads
from engine.offload.loads import Loads
from engine.offload.metrics import OffloadMetrics
from engine.offload.store_queue import StoreQueue
from engine.offload.tier import HostTier
from engine.offload.worker import Job, OffloadWorker
from offloadd.client import OffloadClient, RetryPolicy


class OffloadingConnector:
    """Implements engine.kv_connector.OffloadConnector against an offloadd daemon."""

    def __init__(
        self,
        config: OffloadConnectorConfig,
        client: OffloadClient | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.client = client or OffloadClient(
            config.target, timeout_s=config.timeout_s, retry=RetryPolicy(attempts=2)
        )
        self.incarnation = config.incarnation or time.time_ns() // 1000  # a restart fences the last
        self.metrics = OffloadMetrics()
        if registry is not None:
            self.metrics.register(registry, config.engine_id)
        self.tier = HostTier(config, self.client, self.metrics, self.incarnation)
        self.loads = Loads(config, self.tier, self.metrics, self._submit)
        self.stores = StoreQueue(config, self.tier, self.metrics)
        self.worker: OffloadWorker | None = None
        self._outbox: list[Job] = []
        """The step's jobs, handed to the worker by ``step_done``."""

    def register_kv_caches(self, groups: Sequence[KVCacheGroup]) -> None:
        if not self.tier.attach(groups):
            return
        device = self.tier.groups[0].tensor.device
        if self.config.layerwise:
            self.loads.use_layer_loader(LayerLoader(device, halving=self.config.layer_copies == "halving"))
        self.worker = OffloadWorker(
            self.client, self.config.engine_id, self.config.lease_ms, self.metrics,
            self.tier.mark_unregistered, device,
            on_committed=self.tier.view.learn, on_looked_up=self.loads.learn,
        )

    # -- the step, in order (engine.kv_connector) -----------------------------------------

    def lookup(self, request_id: str, digests: Sequence[bytes], num_gpu_hit_blocks: int) -> int:
        return self.loads.lookup(request_id, digests, num_gpu_hit_blocks)

    def load(
        self, request_id: str, digests: Sequence[bytes], block_ids: Mapping[int, Sequence[int]]
    ) -> None:
        self.loads.load(request_id, digests, block_ids)

    def take_layer_waits(self) -> LayerLoads | None:
        return self.loads.take_layer_waits()

    def finish_loads(self) -> None:
        self._outbox.extend(self.loads.finish())

    def store(self, new_blocks: Sequence[NewBlocks]) -> None:
        self._outbox.extend(
            self.stores.prepare(new_blocks, self.loads.loaded_digests, self.loads.unconfirmed)
        )

    def check_loads(self) -> set[str]:
        checked = self.loads.check()
        self._outbox.extend(checked.touches)
        self._outbox.extend(self.stores.settle(checked.redo))
        self._outbox.extend(checked.releases)
        return checked.redo

    def step_done(self) -> None:
        """Hand the step's stores, releases and hit reports to the worker (after the step's
        outputs were made: the woken worker shares the GIL with this thread from then on)."""
        jobs, self._outbox = self._outbox, []
        for job in jobs:
            self._submit(job)

    def request_finished(self, request_id: str) -> None:
        self.loads.request_finished(request_id)
        self.stores.request_finished(request_id)

    # -- misc ---------------------------------------------------------------------------

    def _submit(self, job: Job) -> None:
        if self.worker is not None:
            self.worker.submit(job)

    def stats(self) -> dict[str, float]:
        """Counters: bytes/blocks stored and loaded, copy seconds, hit tokens per tier, errors."""
        return self.metrics.snapshot()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued store and release is done (tests, benchmarks, shutdown)."""
        self.step_done()
        return self.worker.wait_idle(timeout_s) if self.worker is not None else True

    def close(self) -> None:
        # A step left open (loads issued, not checked) ends in order first.
        self.finish_loads()
        self.check_loads()
        self.step_done()
        self.loads.unpin_all()
        if self.worker is not None:
            self.worker.close()
        self.tier.close()
        self.client.close()
