"""The offload connector: the engine's side of offloadd's host tier (a second KV tier).

- **Store**: after each step, the blocks that became full are snapshotted with one gather per
  group (stream-ordered after the step's compute, so the GPU blocks may be reused right after)
  and handed to :class:`engine.offload.worker.OffloadWorker`, which reserves slots, copies the
  snapshot into the arena (a side stream on CUDA) and commits, which logs ``BlockStored(CPU)``.
- **Load**: on admission, after the GPU prefix hit, the longest prefix that is ready in the host
  tier is pinned under a lease (``lookup``), copied into the freshly allocated blocks (``load``)
  and released once the copy completed. When the engine's own view of the host tier
  (engine.offload.view) holds the whole prefix and the daemon's shared generation table still
  vouches for it, the copies start from the slots it remembers without any RPC, and
  ``check_loads`` checks the table again once they completed, before the step's result is used
  (a slot given away meanwhile redoes that request's step; DECISIONS 22). By default the
  copy runs layer by layer on a load stream and the step waits for each layer right before
  computing it
  (``take_layer_waits``, engine.offload.layerwise), so the copy overlaps the step; with
  ``layerwise`` off it is one copy per group on the compute stream, before the step. A
  hybrid model needs every full-attention block of the prefix and, of the sliding-window group,
  only the blocks that cover the window at its end (engine.offload.lookup).
- The offloaded block may be a multiple of the engine block (``block_size_multiple``,
  engine.offload.store).
- Any daemon failure is logged and counted and the engine runs on without the host tier; an
  unreachable daemon is retried every ``retry_register_s``.

Only ``offloadd.client`` is used to reach the daemon (DESIGN.md 5).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from prometheus_client.registry import CollectorRegistry

from engine.block_pool import NULL_BLOCK_ID
from engine.kv_cache import KVCacheGroup
from engine.kv_connector import NewBlocks
from engine.offload.config import OffloadConnectorConfig
from engine.offload.copies import ArenaBlocks
from engine.offload.layerwise import GroupLoad, LayerLoader, LayerLoads
from engine.offload.lookup import GroupHitInput, hit_length, lookup_keys
from engine.offload.metrics import OffloadMetrics
from engine.offload.store import StoreBatcher
from engine.offload.view import SpeculativeLoad, TierView, leading, vouched
from engine.offload.worker import OffloadWorker, ReleaseJob, StoreJob, TouchJob
from offloadd.client import (
    GroupQuery,
    GroupSpec,
    LookupOutcome,
    OffloadClient,
    OffloadClientError,
    RetryPolicy,
    SlotGenerations,
)

log = logging.getLogger(__name__)


Timing = tuple[torch.cuda.Event, torch.cuda.Event]


@dataclass(frozen=True)
class _Pinned:
    """A lookup's result, pinned under ``lease_id`` until loaded or the request leaves."""

    lease_id: str
    num_blocks: int
    """Engine blocks after the GPU hit that can be loaded."""
    first_block: int
    """Engine index of the first offloaded block's first engine block (<= the GPU hit)."""
    num_gpu_hit: int
    slots: dict[int, tuple[int, ...]]
    """Per group, the daemon slot of each offloaded block from ``first_block`` on."""
    check: SpeculativeLoad | None = None
    """Set when the slots came from the engine's view, unpinned (``check_loads`` checks them)."""


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
        self.k = config.block_size_multiple
        self.batcher = StoreBatcher(self.k)
        self.groups: list[KVCacheGroup] = []
        self.arenas: dict[int, ArenaBlocks] = {}
        self.worker: OffloadWorker | None = None
        self._registered = False
        self._next_register_at = 0.0
        self._pinned: dict[str, _Pinned] = {}
        self._seen: set[str] = set()
        self._just_loaded: set[bytes] = set()
        """Digests loaded this step: the engine reports them as new blocks; no need to store."""
        self._loaded_leases: list[tuple[str, torch.cuda.Event | None, Timing | None]] = []
        """Leases of this step's loads, released (once their copies completed) after the step."""
        self.view = TierView()
        self._tables: dict[int, np.ndarray] = {}
        """Per group, the daemon's generation table (read-only shared memory; engine.offload.view)."""
        self._table_maps: list[SlotGenerations] = []
        self._checks: list[SpeculativeLoad] = []
        """This step's loads from the view, checked once their copies completed (``check_loads``)."""
        self._no_speculation: set[str] = set()
        """Requests whose speculative load failed: their next admission asks first."""
        self._outbox: list[ReleaseJob | StoreJob | TouchJob] = []
        """The step's stores, load releases and hit reports, handed to the worker by ``step_done``."""
        self._held: dict[str, list[StoreJob]] = {}
        """Stores of requests whose load ``check_loads`` has not confirmed yet, by request."""
        self._copied: torch.cuda.Event | None = None
        """After this step's layer-by-layer copies (set by ``store``)."""
        self._stored = False
        """``store`` ran for this step (``step_done`` ends the step)."""
        self._loader: LayerLoader | None = None
        self._layer_loads: LayerLoads | None = None
        """This step's layer-by-layer loads (``layerwise``): the step waits on them per layer."""

    # -- registration -------------------------------------------------------------------

    def register_kv_caches(self, groups: Sequence[KVCacheGroup]) -> None:
        self.groups = list(groups)
        if not self.config.enabled or not self.groups:
            return
        device = self.groups[0].tensor.device
        if self.config.layerwise:
            self._loader = LayerLoader(device)
            self._layer_loads = self._loader.new_step()
        self.worker = OffloadWorker(
            self.client, self.config.engine_id, self.config.lease_ms, self.metrics,
            self._mark_unregistered, device, on_committed=self.view.learn, on_looked_up=self._learn,
        )
        self._register()

    def _specs(self) -> list[GroupSpec]:
        return [
            GroupSpec(
                group_idx=g.spec.group_idx, kind=g.spec.kind,
                sliding_window=g.spec.sliding_window or 0, block_size=g.block_size * self.k,
                block_bytes=g.block_bytes * self.k, dtype=str(g.dtype).removeprefix("torch."),
                layout=f"{g.layout}:{'x'.join(str(d) for d in g.tensor.shape[1:])}",
            )
            for g in self.groups
        ]

    def _register(self) -> bool:
        try:
            reg = self.client.register_engine(
                self.config.engine_id, self.incarnation, self.config.model_namespace, self._specs()
            )
        except OffloadClientError as exc:
            log.warning("offloadd registration failed (retrying in %.1fs): %s",
                        self.config.retry_register_s, exc)
            self.metrics.add(errors=1)
            self._next_register_at = time.monotonic() + self.config.retry_register_s
            return False
        for arena in self.arenas.values():
            arena.close()
        self._close_tables()
        try:
            for g in self.groups:
                self._table_maps.append(reg.map_generations(g.spec.group_idx))
        except (OSError, ValueError) as exc:  # a daemon that publishes none: always ask first
            log.warning("offloadd generation table not mapped (every load asks first): %s", exc)
            self._close_tables()
        self._tables = {g.spec.group_idx: np.frombuffer(t.values, dtype=np.uint64)
                        for g, t in zip(self.groups, self._table_maps, strict=False)}
        self.view.clear(capacity=sum(info.max_slots for info in reg.groups.values()) or None)
        self.arenas = {
            g.spec.group_idx: ArenaBlocks.in_engine_blocks(
                reg.groups[g.spec.group_idx], self.k, g.tensor, self.config.copy_mode
            )
            for g in self.groups
        }
        self._registered = True
        return True

    def _close_tables(self) -> None:
        self._tables = {}  # the arrays go first: they hold the maps' buffers
        for t in self._table_maps:
            t.close()
        self._table_maps = []

    def _mark_unregistered(self) -> None:
        self._registered = False  # the daemon forgot us (e.g. a cold restart): register again

    def _active(self) -> bool:
        if not self.config.enabled or self.worker is None:
            return False
        if self._registered:
            return True
        if time.monotonic() < self._next_register_at:
            return False
        return self._register()

    # -- load ---------------------------------------------------------------------------

    def lookup(self, request_id: str, digests: Sequence[bytes], num_gpu_hit_blocks: int) -> int:
        self._unpin(request_id)  # an admission retried after a shortage looks up again
        if request_id not in self._seen:
            self._seen.add(request_id)
            self.metrics.add(gpu_hit_tokens=num_gpu_hit_blocks * self._block_size())
        k, hit = self.k, num_gpu_hit_blocks
        first, keys = lookup_keys(digests, hit, k)
        if not keys or not self.config.load or not self._active():
            return 0
        # Sliding-window groups look up every key: only the window at the end is needed.
        queries = [GroupQuery(g.spec.group_idx, keys, prefix_only=g.spec.sliding_window is None)
                   for g in self.groups]
        if self.config.speculate and request_id not in self._no_speculation:
            num_ext = self._speculate(request_id, queries, first, hit)
            if num_ext is not None:
                return num_ext
        try:
            outcome = self.client.lookup(self.config.engine_id, queries, pin=True,
                                         lease_ms=self.config.lease_ms)
        except OffloadClientError as exc:
            self._failed("lookup", exc)
            return 0
        self.metrics.add(lookups=1)
        self._learn(keys, outcome)
        results = {r.group_idx: r for r in outcome.results}
        inputs = {
            g.spec.group_idx: GroupHitInput(
                g.spec.sliding_window,
                results[g.spec.group_idx].num_prefix if g.spec.group_idx in results else 0,
                results[g.spec.group_idx].slots if g.spec.group_idx in results else (-1,) * len(keys),
            )
            for g in self.groups
        }
        num = hit_length(inputs, len(keys), first, hit, k, self._block_size())
        if num == 0:
            if outcome.lease_id:
                self._release_later(outcome.lease_id, None)
            return 0
        num_ext = (first + num) * k - hit
        self._pinned[request_id] = _Pinned(
            outcome.lease_id, num_ext, first * k, hit,
            {gi: x.slots[:num] for gi, x in inputs.items()},
        )
        return num_ext

    def _speculate(self, request_id: str, queries: list[GroupQuery], first: int, hit: int) -> int | None:
        """When the view holds every key of the lookup and the generation table still vouches
        for it: take the view's slots for ``load`` (nothing pinned, nothing sent) and return the
        hit; else None (ask first: the daemon may know more than the view)."""
        if len(self._tables) != len(self.groups):
            return None
        keys = queries[0].block_hashes
        known: dict[int, tuple[list[int], list[int]]] = {}
        inputs: dict[int, GroupHitInput] = {}
        for g in self.groups:
            gi = g.spec.group_idx
            slots, gens = self.view.find(gi, keys)
            slots = vouched(self._tables[gi], slots, gens)
            known[gi] = (slots, gens)
            inputs[gi] = GroupHitInput(g.spec.sliding_window, leading(slots), tuple(slots))
        if hit_length(inputs, len(keys), first, hit, self.k, self._block_size()) < len(keys):
            return None
        check = SpeculativeLoad(request_id, queries, known)
        num_ext = (first + len(keys)) * self.k - hit
        self._pinned[request_id] = _Pinned(
            "", num_ext, first * self.k, hit, {gi: tuple(s) for gi, (s, _) in known.items()}, check,
        )
        return num_ext

    def _learn(self, keys: Sequence[bytes], outcome: LookupOutcome) -> None:
        """Keep the daemon's answer in the view (prefix-only answers stop at the first miss)."""
        for r in outcome.results:
            n = len(r.slots)
            if len(r.generations) == n <= len(keys):
                self.view.learn(r.group_idx, keys[:n], r.slots, r.generations)

    def check_loads(self) -> set[str]:
        """After ``store``, before the step's result is used: the requests whose loads from
        the view read a slot that was given away (or taken out of service) meanwhile. Their
        step's result must be dropped (the stores prepared for them are) and they must be
        admitted again (they then ask first)."""
        checks, self._checks = self._checks, []
        bad: set[str] = set()
        for check in checks:
            if not self._confirm(check):
                bad.add(check.request_id)
                self._no_speculation.add(check.request_id)
        held, self._held = self._held, {}
        for request_id, jobs in held.items():
            if request_id not in bad:
                self._outbox.extend(jobs)
                continue
            self.batcher.drop(request_id)
            for job in jobs:
                self.metrics.add(pending_store_bytes=-job.staging.nbytes)
        self._release_loaded()
        return bad

    def _confirm(self, check: SpeculativeLoad) -> bool:
        done = check.done or self._copied  # a whole load's own event, or the step's copies
        if done is not None:
            done.synchronize()  # they end before the step's compute does
        ok = check.still_valid(self._tables)
        self.metrics.add(speculative_loads=int(ok), speculation_failed=int(not ok),
                         cpu_hit_tokens=0 if ok else -check.tokens)
        self._loaded_leases.append(("", check.done, check.timing))  # its copy time
        if ok:
            self._outbox.append(TouchJob(check.queries))
        return ok

    def load(
        self, request_id: str, digests: Sequence[bytes], block_ids: Mapping[int, Sequence[int]]
    ) -> None:
        pinned = self._pinned.pop(request_id, None)
        n = len(digests)
        if pinned is None or n > pinned.num_blocks:
            raise RuntimeError(
                f"load of {n} blocks for {request_id!r} without a matching lookup "
                f"({0 if pinned is None else pinned.num_blocks} pinned)"
            )
        cuda = self.groups[0].tensor.device.type == "cuda"
        # Layer by layer, the step's copies are timed once (by its first load's timing events).
        first = self._layer_loads is None or self._layer_loads.empty
        timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda and first else None
        t0 = time.perf_counter()
        nbytes = 0
        used: dict[int, set[int]] = {}
        try:
            k, start = self.k, pinned.num_gpu_hit - pinned.first_block
            # In numpy: a 4096-token hit plans 256 blocks, on the host's path to its first copy.
            positions = np.arange(start, start + n)  # engine blocks from first_block on
            plan: list[GroupLoad] = []
            for g in self.groups:
                gi = g.spec.group_idx
                ids = np.asarray(block_ids[gi][:n], dtype=np.int64)
                if len(ids) != n:
                    raise RuntimeError(f"group {gi}: {len(ids)} block ids for a load of {n} blocks")
                # Null ids: sliding-window blocks already outside the window, left unloaded.
                keep = ids != NULL_BLOCK_ID
                pos = positions if keep.all() else positions[keep]
                offloaded = pos // k
                slots = np.asarray(pinned.slots[gi], dtype=np.int64)[offloaded]
                if (slots < 0).any():
                    raise RuntimeError(f"group {gi}: asked to load a block the lookup did not find")
                used[gi] = set(offloaded.tolist())
                plan.append(GroupLoad(gi, self.arenas[gi], g.tensor, ids[keep].tolist(),
                                      (slots * k + pos % k).tolist()))
                nbytes += len(pos) * g.block_bytes
            done = self._issue(plan, timing)
        except Exception:
            self._unpinned(pinned)
            raise
        if timing is None and self._loader is None:
            self.metrics.add(load_copy_seconds=time.perf_counter() - t0)
        self.metrics.add(blocks_loaded=n, bytes_loaded=nbytes, cpu_hit_tokens=n * self._block_size())
        self._just_loaded.update(digests)
        # Released by store() and step_done(), after the step: waking the worker now would have
        # it share the GIL with this thread while the step is being launched.
        if pinned.check is not None:  # nothing pinned: check_loads checks the slots read
            check = pinned.check
            check.used, check.done, check.timing, check.tokens = used, done, timing, n * self._block_size()
            self._checks.append(check)
        else:
            self._loaded_leases.append((pinned.lease_id, done, timing))

    def _issue(self, plan: list[GroupLoad], timing: Timing | None) -> torch.cuda.Event | None:
        """Start the copies; on CUDA, return the event after the last one (None layer by
        layer: that event is made once the step is done, _finish_loads)."""
        if self._loader is not None and self._layer_loads is not None:
            self._loader.load(plan, self._layer_loads, timing)
            return None
        if timing is not None:
            timing[0].record()
        for x in plan:
            self.arenas[x.group_idx].read(x.kv, x.block_ids, x.slots)
        if timing is None:
            return None
        timing[1].record()
        return timing[1]

    def take_layer_waits(self) -> LayerLoads | None:
        """This step's loads still in flight, layer by layer (None: all complete in stream order)."""
        loads = self._layer_loads
        return None if loads is None or loads.empty else loads

    def _finish_loads(self) -> torch.cuda.Event | None:
        """After the step: every load issued and complete in stream order, CPU copy time
        counted; on CUDA, an event after the last copy."""
        if self._layer_loads is None:
            return None
        done = self._layer_loads.finish()
        if self._layer_loads.copy_seconds:
            self.metrics.add(load_copy_seconds=self._layer_loads.copy_seconds)
            self._layer_loads.copy_seconds = 0.0
        return done

    def request_finished(self, request_id: str) -> None:
        self._unpin(request_id)
        self.batcher.drop(request_id)
        self._seen.discard(request_id)
        self._no_speculation.discard(request_id)

    def _release_loaded(self) -> None:
        """Release the step's load leases once their copies completed (a whole load's own
        event, or the one after this step's layer-by-layer copies)."""
        leases, self._loaded_leases = self._loaded_leases, []
        self._outbox.extend(ReleaseJob(lease_id, done or self._copied, timing)
                            for lease_id, done, timing in leases if lease_id or timing)

    def _unpin(self, request_id: str) -> None:
        pinned = self._pinned.pop(request_id, None)
        if pinned is not None:
            self._unpinned(pinned)

    def _unpinned(self, pinned: _Pinned) -> None:
        """Release a pin that will not be loaded (a load from the view holds none)."""
        self._release_later(pinned.lease_id, None)

    def _release_later(self, lease_id: str, done: torch.cuda.Event | None, timing: Timing | None = None) -> None:
        if lease_id and self.worker is not None:
            self.worker.submit(ReleaseJob(lease_id, done, timing))

    # -- store --------------------------------------------------------------------------

    def store(self, new_blocks: Sequence[NewBlocks]) -> None:
        self._stored = True
        self._copied = self._finish_loads()
        self._release_loaded()
        skip, self._just_loaded = self._just_loaded, set()
        if not new_blocks or not self.config.store or not self._active():
            return
        assert self.worker is not None
        # Blocks of a request whose load is not confirmed yet are held apart until it is.
        unconfirmed = {c.request_id for c in self._checks}
        by_group: dict[tuple[int, str], list[NewBlocks]] = {}
        for nb in new_blocks:
            key = nb.request_id if nb.request_id in unconfirmed else ""
            by_group.setdefault((nb.group_idx, key), []).append(nb)
        groups = {g.spec.group_idx: g for g in self.groups}
        for (gi, key), batch in by_group.items():
            self._store_group(groups[gi], batch, skip, self._held.setdefault(key, []) if key else self._outbox)

    def _store_group(self, group: KVCacheGroup, batch: list[NewBlocks], skip: set[bytes],
                     into: list[StoreJob] | list[ReleaseJob | StoreJob | TouchJob]) -> None:
        assert self.worker is not None
        arena = self.arenas[group.spec.group_idx]
        if self.metrics.counters.pending_store_bytes > self.config.max_pending_store_bytes:
            self.metrics.add(stores_dropped=1)
            return
        out = self.batcher.batch(group, arena, batch, skip)
        if out is None:
            return
        nbytes = out.staging.nbytes
        if self.metrics.counters.pending_store_bytes + nbytes > self.config.max_pending_store_bytes:
            self.metrics.add(stores_dropped=1)
            return
        ready = None
        if out.staging.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        self.metrics.add(pending_store_bytes=nbytes)
        into.append(StoreJob(group.spec.group_idx, arena, out.staging, ready, out.blocks, self.k))

    def step_done(self) -> None:
        """Hand the step's stores and releases to the worker (after the step's outputs were
        made: the woken worker shares the GIL with this thread from then on)."""
        if self._checks or self._held:  # the step failed before check_loads: settle its leases
            if not self._stored:
                self.store([])
            self.check_loads()
        self._stored, self._copied = False, None
        jobs, self._outbox = self._outbox, []
        if self.worker is not None:
            for job in jobs:
                self.worker.submit(job)

    # -- misc ---------------------------------------------------------------------------

    def _block_size(self) -> int:
        return self.groups[0].block_size if self.groups else 0

    def _failed(self, what: str, exc: OffloadClientError) -> None:
        log.warning("offload %s failed: %s", what, exc)
        self.metrics.add(errors=1)
        if "not registered" in exc.message:
            self._mark_unregistered()

    def stats(self) -> dict[str, float]:
        """Counters: bytes/blocks stored and loaded, copy seconds, hit tokens per tier, errors."""
        return self.metrics.snapshot()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued store and release is done (tests, benchmarks, shutdown)."""
        self.step_done()
        return self.worker.wait_idle(timeout_s) if self.worker is not None else True

    def close(self) -> None:
        self.store([])
        self.step_done()
        for request_id in list(self._pinned):
            self._unpin(request_id)
        if self.worker is not None:
            self.worker.close()
        for arena in self.arenas.values():
            arena.close()
        self._close_tables()
        self.client.close()
