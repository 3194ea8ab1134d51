"""Counters of the offload connector: bytes and blocks moved, copy times, hits per tier, errors.

Updated by the engine thread and the store worker under one lock; read as a plain dict by
``OffloadingConnector.stats()`` and, when a Prometheus registry is given, exported by a collector
(no module-level metric objects, so two engines in one process never clash).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry


@dataclass
class OffloadCounters:
    lookups: int = 0
    speculative_loads: int = 0
    """Loads started from the engine's own view of the host tier without asking
    (engine.offload.view) whose slots the generation table still vouched for after the copy."""
    speculation_failed: int = 0
    """Such loads that read a slot given away meanwhile: the request's step was dropped and redone."""
    gpu_hit_tokens: int = 0
    """Prompt tokens served by the engine's own prefix cache, at first admission."""
    cpu_hit_tokens: int = 0
    """Prompt tokens loaded from the host tier instead of recomputed."""
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_copy_seconds: float = 0.0
    blocks_stored: int = 0
    """Blocks copied into the arena and committed."""
    bytes_stored: int = 0
    store_copy_seconds: float = 0.0
    blocks_already_stored: int = 0
    blocks_in_flight: int = 0
    """Blocks another engine was storing at the same time (skipped)."""
    blocks_no_space: int = 0
    stores_dropped: int = 0
    """Store batches dropped because too many bytes were waiting (generation never waits)."""
    errors: int = 0
    """Daemon calls that failed (logged; generation went on without the host tier)."""
    pending_store_bytes: int = 0


@dataclass
class OffloadMetrics:
    counters: OffloadCounters = field(default_factory=OffloadCounters)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **deltas: float) -> None:
        with self.lock:
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)

    def snapshot(self) -> dict[str, float]:
        with self.lock:
            return {f.name: getattr(self.counters, f.name) for f in fields(self.counters)}

    def register(self, registry: CollectorRegistry, engine_id: str) -> None:
        registry.register(_Collector(self, engine_id))


_GAUGES = frozenset({"pending_store_bytes"})


class _Collector(Collector):
    def __init__(self, metrics: OffloadMetrics, engine_id: str) -> None:
        self.metrics = metrics
        self.engine_id = engine_id

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        for name, value in self.metrics.snapshot().items():
            full = f"kv_engine_offload_{name}"
            family: CounterMetricFamily | GaugeMetricFamily
            if name in _GAUGES:
                family = GaugeMetricFamily(full, f"offload connector {name}", labels=["engine_id"])
            else:
                family = CounterMetricFamily(full, f"offload connector {name}", labels=["engine_id"])
            family.add_metric([self.engine_id], float(value))
            yield family
