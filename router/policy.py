"""Where a request goes: the KV-aware score, and round-robin, least-loaded and random.

KV-aware, per engine in rotation: the request's leading blocks resident in that engine's GPU
tier (``g``), then, from there on, those in its node's host tier (``c``), as the engine itself
admits a request (GPU prefix hit first, then a host-tier load of what follows). Its score is
``block_size * (gpu_weight * g + cpu_weight * c) - load_weight * in_flight``; the best score
wins, ties go to the less loaded, then in turn. ``g + c`` blocks are the predicted cached prefix.

With ``model_pressure`` the GPU run is the one expected at the engine's admission rather than
the one in the view (router.pressure): longer by this router's finished requests whose events
are still on their way, shorter by the evictions its requests in flight will cause first.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from events.schema import BlockHash
from events.state import CacheState
from router.config import RouterConfig
from router.fleet import EngineState

REASONS = ("gpu_prefix", "cpu_prefix", "load", "no_prefix", "no_cache_view",
           "round_robin", "least_loaded", "random")
"""Why an engine was chosen: its GPU / host-tier prefix was the best score; a longer prefix
elsewhere lost to load; nobody had a prefix (least loaded); the cache view is not ready yet
(least loaded); or the policy is not KV-aware."""


@dataclass(frozen=True)
class Decision:
    engine: EngineState
    reason: str
    gpu_blocks: int
    """Predicted leading blocks in the engine's GPU tier."""
    cpu_blocks: int
    """Predicted blocks after those, in its node's host tier."""
    at_risk_blocks: int = 0
    """GPU blocks of the view's run expected to be evicted before the admission (not predicted)."""


def prefix_run(state: CacheState, hashes: Sequence[BlockHash], engine: EngineState,
               pressure: bool = False) -> tuple[int, int]:
    """``(g, c)``: leading blocks in the engine's GPU tier, then in its node's host tier;
    ``pressure``: the GPU run expected at admission (router.pressure), not the view's."""
    g, c, _ = _runs(state, hashes, engine, pressure)
    return g, c


def _runs(state: CacheState, hashes: Sequence[BlockHash], engine: EngineState,
          pressure: bool, cpu_ends: dict[tuple[str, int], int] | None = None) -> tuple[int, int, int]:
    """``(g, c, at_risk)``; ``cpu_ends`` remembers host-tier runs across the engines of a node."""
    gpu = state.resident(engine.spec.source, "GPU")
    g = 0
    n = len(hashes)
    if gpu:
        while g < n and hashes[g] in gpu:
            g += 1
    seen = g
    if pressure:
        g = engine.pressure.surviving(gpu, hashes, g)
    node = engine.spec.node_source
    c = cpu_ends.get((node, g)) if cpu_ends is not None else None
    if c is None:
        cpu = state.resident(node, "CPU")
        c = g
        if cpu:
            while c < n and hashes[c] in cpu:
                c += 1
        if cpu_ends is not None:
            cpu_ends[(node, g)] = c
    return g, c - g, max(0, seen - g)


class Chooser:
    """One per router: keeps the round-robin position and the random generator."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._turn = 0
        self._rng = random.Random(config.seed)

    def choose(self, candidates: list[EngineState], hashes: Sequence[BlockHash],
               state: CacheState | None) -> Decision:
        """``candidates`` non-empty; ``state`` None while there is no cache view."""
        policy = self.config.policy
        order = self._in_turn(candidates)
        if policy == "kv" and state is not None:
            return self._kv(order, hashes, state)
        if policy == "round-robin":
            engine, reason = order[0], "round_robin"
        elif policy == "random":
            engine, reason = self._rng.choice(candidates), "random"
        else:
            engine = min(order, key=lambda e: e.load)
            reason = "least_loaded" if policy == "least-loaded" else "no_cache_view"
        g, c, risk = _runs(state, hashes, engine, self.config.model_pressure) if state is not None else (0, 0, 0)
        return Decision(engine, reason, g, c, risk)

    def _in_turn(self, candidates: list[EngineState]) -> list[EngineState]:
        k = self._turn % len(candidates)
        self._turn += 1
        return candidates[k:] + candidates[:k]

    def _kv(self, order: list[EngineState], hashes: Sequence[BlockHash], state: CacheState) -> Decision:
        cfg = self.config
        gpu_w, cpu_w = cfg.block_size * cfg.gpu_weight, cfg.block_size * cfg.cpu_weight
        best: tuple[float, int] | None = None
        chosen = (order[0], 0, 0, 0)
        longest = 0
        cpu_ends: dict[tuple[str, int], int] = {}
        for engine in order:
            g, c, risk = _runs(state, hashes, engine, cfg.model_pressure, cpu_ends)
            longest = max(longest, g + c)
            load = engine.load
            key = (gpu_w * g + cpu_w * c - cfg.load_weight * load, -load)
            if best is None or key > best:
                best, chosen = key, (engine, g, c, risk)
        engine, g, c, risk = chosen
        if g + c < longest:
            reason = "load"
        elif g + c == 0:
            reason = "no_prefix"
        else:
            reason = "gpu_prefix" if g else "cpu_prefix"
        return Decision(engine, reason, g, c, risk)
