"""Loads from the host tier: planned at admission, finished after the step, then checked.

A load goes through these collections, in order:

1. ``_pinned``: at admission, ``lookup`` found the longest prefix ready in the host tier. When
   the engine's view (engine.offload.view) holds all of it and the daemon's generation table
   still vouches for it, the slots come from the view, nothing pinned and nothing sent
   (DECISIONS 20-22); otherwise a pinning Lookup asks the daemon.
2. ``load`` issues the copies into the freshly allocated blocks: layer by layer on a load stream
   by default (the step waits per layer: ``take_layer_waits``, engine.offload.layerwise), or one
   copy per group before the step. Its lease or its check is kept with the step's loads.
3. ``finish``, after the step was enqueued (whatever it did): every load of the step is complete
   in stream order; the step's copy event is given to each of them. The leases of pinned loads
   are released once that event completed; the loads from the view wait for ``check``.
4. ``check``, before the step's result is used: each load from the view must still find the
   generations it read in the table (a slot given away meanwhile redoes that request's step).

Nothing here wakes the worker: the jobs made (releases, hit reports) are returned to the
connector, which hands them over once the step's outputs are made.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from engine.offload.config import OffloadConnectorConfig
from engine.offload.layer_plan import GroupLoad
from engine.offload.layerwise import LayerLoader, LayerLoads
from engine.offload.lookup import GroupHitInput, hit_length, lookup_keys, plan_load
from engine.offload.metrics import OffloadMetrics
from engine.offload.tier import HostTier
from engine.offload.view import SpeculativeLoad, vouched_hit
from engine.offload.worker import Job, ReleaseJob, TouchJob
from offloadd.client import GroupQuery, LookupOutcome, OffloadClientError

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
    """Set when the slots came from the engine's view, unpinned (``check`` checks them)."""


@dataclass
class LoadsChecked:
    """What ``Loads.check`` found, in the order its jobs go to the worker."""

    redo: set[str] = field(default_factory=set)
    """Requests whose loads read a slot given away meanwhile: their step's result is dropped."""
    touches: list[TouchJob] = field(default_factory=list)
    """Hits loaded without asking, to report to the daemon."""
    releases: list[ReleaseJob] = field(default_factory=list)
    """Nothing to release (no lease): they count the loads' copy time once it completed."""


class Loads:
    """The host-tier loads of admitted requests (see the module docstring for their order)."""

    def __init__(
        self, config: OffloadConnectorConfig, tier: HostTier, metrics: OffloadMetrics,
        submit: Callable[[Job], None],
    ) -> None:
        self.config = config
        self.tier = tier
        self.metrics = metrics
        self._submit = submit
        """Hands a job to the worker now (a lease no load will use: nothing waits for it)."""
        self.loader: LayerLoader | None = None
        self._layer_loads: LayerLoads | None = None
        self._pinned: dict[str, _Pinned] = {}
        self._seen: set[str] = set()
        self._no_speculation: set[str] = set()
        """Requests whose load from the view failed: their next admission asks first."""
        self._issued_releases: list[ReleaseJob] = []
        """This step's pinned loads: their leases, released once their copies completed."""
        self._issued_checks: list[SpeculativeLoad] = []
        """This step's loads from the view, copies possibly in flight."""
        self._copied_checks: list[SpeculativeLoad] = []
        """Loads from the view whose copies are complete in stream order, not checked yet."""
        self._issued_digests: set[bytes] = set()
        self.loaded_digests: set[bytes] = set()
        """Digests the finished step loaded: the engine reports them as new blocks, and they
        need no store."""

    def use_layer_loader(self, loader: LayerLoader) -> None:
        """Load layer by layer (``layerwise``): the step waits for each layer before it."""
        self.loader = loader
        self._layer_loads = loader.new_step()

    @property
    def unconfirmed(self) -> set[str]:
        """Requests whose loads from the view are finished but not checked yet."""
        return {c.request_id for c in self._copied_checks}

    # -- admission ----------------------------------------------------------------------

    def lookup(self, request_id: str, digests: Sequence[bytes], num_gpu_hit_blocks: int) -> int:
        """Engine blocks after the GPU hit that ``load`` can load (engine.kv_connector)."""
        self._unpin(request_id)  # an admission retried after a shortage looks up again
        block_size = self.tier.block_size
        if request_id not in self._seen:
            self._seen.add(request_id)
            self.metrics.add(gpu_hit_tokens=num_gpu_hit_blocks * block_size)
        k, hit = self.tier.k, num_gpu_hit_blocks
        first, keys = lookup_keys(digests, hit, k)
        if not keys or not self.config.load or not self.tier.is_active():
            return 0
        # Sliding-window groups look up every key: only the window at the end is needed.
        queries = [GroupQuery(g.spec.group_idx, keys, prefix_only=g.spec.sliding_window is None)
                   for g in self.tier.groups]
        if self.config.speculate and request_id not in self._no_speculation:
            num_ext = self._speculate(request_id, queries, first, hit)
            if num_ext is not None:
                return num_ext
        try:
            outcome = self.tier.client.lookup(self.config.engine_id, queries, pin=True,
                                              lease_ms=self.config.lease_ms)
        except OffloadClientError as exc:
            self.tier.failed("lookup", exc)
            return 0
        self.metrics.add(lookups=1)
        self.learn(keys, outcome)
        results = {r.group_idx: r for r in outcome.results}
        inputs = {
            g.spec.group_idx: GroupHitInput(
                g.spec.sliding_window,
                results[g.spec.group_idx].num_prefix if g.spec.group_idx in results else 0,
                results[g.spec.group_idx].slots if g.spec.group_idx in results else (-1,) * len(keys),
            )
            for g in self.tier.groups
        }
        num = hit_length(inputs, len(keys), first, hit, k, block_size)
        if num == 0:
            self._release_now(outcome.lease_id)
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
        tier = self.tier
        keys = queries[0].block_hashes
        known = vouched_hit(tier.view, tier.tables, tier.groups, keys, first, hit, tier.k, tier.block_size)
        if known is None:
            return None
        check = SpeculativeLoad(request_id, queries, known)
        num_ext = (first + len(keys)) * tier.k - hit
        self._pinned[request_id] = _Pinned(
            "", num_ext, first * tier.k, hit, {gi: tuple(s) for gi, (s, _) in known.items()}, check,
        )
        return num_ext

    def learn(self, keys: Sequence[bytes], outcome: LookupOutcome) -> None:
        """Keep the daemon's answer in the view (prefix-only answers stop at the first miss)."""
        for r in outcome.results:
            n = len(r.slots)
            if len(r.generations) == n <= len(keys):
                self.tier.view.learn(r.group_idx, keys[:n], r.slots, r.generations)

    def load(self, request_id: str, digests: Sequence[bytes], block_ids: Mapping[int, Sequence[int]]) -> None:
        """Issue the copies of a looked-up hit (engine.kv_connector); raises before copying
        anything on bad input."""
        pinned = self._pinned.pop(request_id, None)
        n = len(digests)
        if pinned is None or n > pinned.num_blocks:
            raise RuntimeError(
                f"load of {n} blocks for {request_id!r} without a matching lookup "
                f"({0 if pinned is None else pinned.num_blocks} pinned)"
            )
        cuda = self.tier.groups[0].tensor.device.type == "cuda"
        # Layer by layer, the step's copies are timed once (by its first load's timing events).
        first = self._layer_loads is None or self._layer_loads.empty
        timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda and first else None
        t0 = time.perf_counter()
        try:
            plan, used, nbytes = plan_load(
                self.tier.groups, self.tier.arenas, self.tier.k, pinned.slots,
                pinned.num_gpu_hit - pinned.first_block, block_ids, n,
            )
            done = self._issue(plan, timing)
        except Exception:
            self._release_now(pinned.lease_id)
            raise
        if timing is None and self.loader is None:
            self.metrics.add(load_copy_seconds=time.perf_counter() - t0)
        tokens = n * self.tier.block_size
        self.metrics.add(blocks_loaded=n, bytes_loaded=nbytes, cpu_hit_tokens=tokens)
        self._issued_digests.update(digests)
        # Released (or checked) after the step: waking the worker now would have it share the
        # GIL with this thread while the step is being launched.
        if pinned.check is not None:  # nothing pinned: ``check`` checks the slots read
            check = pinned.check
            check.used, check.done, check.timing, check.tokens = used, done, timing, tokens
            self._issued_checks.append(check)
        else:
            self._issued_releases.append(ReleaseJob(pinned.lease_id, done, timing))

    def _issue(self, plan: list[GroupLoad], timing: Timing | None) -> torch.cuda.Event | None:
        """Start the copies; on CUDA, return the event after the last one (None layer by
        layer: ``finish`` makes that event once the step is enqueued)."""
        if self.loader is not None and self._layer_loads is not None:
            self.loader.load(plan, self._layer_loads, timing)
            return None
        if timing is not None:
            timing[0].record()
        for x in plan:
            self.tier.arenas[x.group_idx].read(x.kv, x.block_ids, x.slots)
        if timing is None:
            return None
        timing[1].record()
        return timing[1]

    def take_layer_waits(self) -> LayerLoads | None:
        """This step's loads still in flight, layer by layer (None: all complete in stream order)."""
        loads = self._layer_loads
        return None if loads is None or loads.empty else loads

    # -- after the step -----------------------------------------------------------------

    def finish(self) -> list[ReleaseJob]:
        """After the step was enqueued, whatever it did: every load of the step issued and
        complete in stream order (CPU copy time counted). Returns the releases of its pinned
        loads, each after its copies; its loads from the view wait for ``check``. Once per
        step; a second call finds nothing left to finish."""
        copied = self._finish_layers()
        for check in self._issued_checks:
            check.done = check.done or copied  # a whole load's own event, or the step's copies
        self._copied_checks.extend(self._issued_checks)
        self._issued_checks = []
        self.loaded_digests, self._issued_digests = self._issued_digests, set()
        releases, self._issued_releases = self._issued_releases, []
        for job in releases:
            job.done = job.done or copied
        return [job for job in releases if job.lease_id or job.timing]

    def _finish_layers(self) -> torch.cuda.Event | None:
        """Layer by layer: issue and complete what the step did not wait for; on CUDA, an
        event after the last copy."""
        if self._layer_loads is None:
            return None
        done = self._layer_loads.finish()
        if self._layer_loads.copy_seconds:
            self.metrics.add(load_copy_seconds=self._layer_loads.copy_seconds)
            self._layer_loads.copy_seconds = 0.0
        return done

    def check(self) -> LoadsChecked:
        """After ``finish``, before the step's result is used: check every finished load from
        the view once its copies completed (they end before the step's compute does)."""
        checks, self._copied_checks = self._copied_checks, []
        out = LoadsChecked()
        for check in checks:
            if check.done is not None:
                check.done.synchronize()
            ok = check.still_valid(self.tier.tables)
            self.metrics.add(speculative_loads=int(ok), speculation_failed=int(not ok),
                             cpu_hit_tokens=0 if ok else -check.tokens)
            if ok:
                out.touches.append(TouchJob(check.queries))
            else:
                out.redo.add(check.request_id)
                self._no_speculation.add(check.request_id)
            if check.timing is not None:  # its copy time
                out.releases.append(ReleaseJob("", check.done, check.timing))
        return out

    # -- requests leaving ---------------------------------------------------------------

    def request_finished(self, request_id: str) -> None:
        self._unpin(request_id)
        self._seen.discard(request_id)
        self._no_speculation.discard(request_id)

    def unpin_all(self) -> None:
        """Release every lease of a lookup not loaded (shutdown)."""
        for request_id in list(self._pinned):
            self._unpin(request_id)

    def _unpin(self, request_id: str) -> None:
        pinned = self._pinned.pop(request_id, None)
        if pinned is not None:
            self._release_now(pinned.lease_id)  # a load from the view holds none

    def _release_now(self, lease_id: str) -> None:
        if lease_id:
            self._submit(ReleaseJob(lease_id, None))
