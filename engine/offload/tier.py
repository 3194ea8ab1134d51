"""The engine's registration with offloadd's host tier and what comes with it.

Registering maps, per KV-cache group, the daemon's arena (engine.offload.copies) and its
generation table (read-only shared memory, engine.offload.view), and starts the engine's view
of the tier afresh (the daemon may have restarted). A daemon that cannot be reached, or that
forgot the engine (a cold restart: calls fail with ``NotRegistered``), leaves the engine
running without the host tier; registration is tried again every ``retry_register_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from engine.kv_cache import KVCacheGroup
from engine.offload.config import OffloadConnectorConfig
from engine.offload.copies import ArenaBlocks
from engine.offload.metrics import OffloadMetrics
from engine.offload.view import TierView
from offloadd.client import (
    GroupSpec,
    NotRegistered,
    OffloadClient,
    OffloadClientError,
    SlotGenerations,
)

log = logging.getLogger(__name__)


class HostTier:
    """The host tier as this engine is registered with it: groups, arenas, generation tables
    and the view. Loads and stores use it only while :meth:`is_active`."""

    def __init__(
        self, config: OffloadConnectorConfig, client: OffloadClient, metrics: OffloadMetrics,
        incarnation: int,
    ) -> None:
        self.config = config
        self.client = client
        self.metrics = metrics
        self.incarnation = incarnation
        self.k = config.block_size_multiple
        """Engine blocks per offloaded block."""
        self.groups: list[KVCacheGroup] = []
        self.arenas: dict[int, ArenaBlocks] = {}
        self.tables: dict[int, np.ndarray] = {}
        """Per group, the daemon's generation table; empty when the daemon publishes none."""
        self.view = TierView()
        self._table_maps: list[SlotGenerations] = []
        self._is_registered = False
        self._is_attached = False
        self._next_register_at = 0.0

    @property
    def block_size(self) -> int:
        """Tokens per engine block (0 before the groups are known)."""
        return self.groups[0].block_size if self.groups else 0

    def attach(self, groups: Sequence[KVCacheGroup]) -> bool:
        """Take the engine's groups; register when the tier is in use. Returns whether it is
        (enabled, with groups): only then are there loads and stores."""
        self.groups = list(groups)
        self._is_attached = self.config.enabled and bool(self.groups)
        if self._is_attached:
            self.register()
        return self._is_attached

    def is_active(self) -> bool:
        """Registered now, or registered again once the retry delay passed."""
        if not self._is_attached:
            return False
        if self._is_registered:
            return True
        if time.monotonic() < self._next_register_at:
            return False
        return self.register()

    def register(self) -> bool:
        """Register (again) and map the arenas and generation tables it offers."""
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
        self.tables = {g.spec.group_idx: np.frombuffer(t.values, dtype=np.uint64)
                       for g, t in zip(self.groups, self._table_maps, strict=False)}
        self.view.clear(capacity=sum(info.max_slots for info in reg.groups.values()) or None)
        self.arenas = {
            g.spec.group_idx: ArenaBlocks.in_engine_blocks(
                reg.groups[g.spec.group_idx], self.k, g.tensor, self.config.copy_mode
            )
            for g in self.groups
        }
        self._is_registered = True
        return True

    def mark_unregistered(self) -> None:
        """The daemon forgot this engine (e.g. a cold restart): register again before use."""
        self._is_registered = False

    def failed(self, what: str, exc: OffloadClientError) -> None:
        """A call failed: logged and counted; the engine goes on without that call's result."""
        log.warning("offload %s failed: %s", what, exc)
        self.metrics.add(errors=1)
        if isinstance(exc, NotRegistered):
            self.mark_unregistered()

    def close(self) -> None:
        for arena in self.arenas.values():
            arena.close()
        self._close_tables()

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

    def _close_tables(self) -> None:
        self.tables = {}  # the arrays go first: they hold the maps' buffers
        for t in self._table_maps:
            t.close()
        self._table_maps = []
