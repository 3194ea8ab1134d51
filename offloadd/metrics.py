"""Prometheus metrics of the daemon, in a registry of its own (no process-global state).

State-derived values (blocks and bytes per tier, hits, misses, evictions, log offset) are read
from the store when scraped; RPC latencies and ingest lag are observed as they happen.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from offloadd.log.checkpoint import CheckpointStats
from offloadd.log.ingest import Ingest
from offloadd.tier.store import HostStore

if TYPE_CHECKING:  # the fleet (and its client) is imported only when peers are configured
    from offloadd.fleet.fill import FillStats

_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5,
)


class _StateCollector(Collector):
    def __init__(self, store: HostStore, ingest: Ingest) -> None:
        self.store = store
        self.ingest = ingest

    def collect(self) -> Iterator[Metric]:
        store, ingest = self.store, self.ingest
        blocks = GaugeMetricFamily(
            "offloadd_blocks", "Resident blocks per tier", labels=["tier", "layout", "state"]
        )
        nbytes = GaugeMetricFamily("offloadd_bytes", "Bytes of resident blocks", labels=["tier"])
        cpu_bytes = 0
        for lay in store.all_layouts():  # one atomic copy under the GIL (collector thread)
            lid = str(lay.layout_id)
            blocks.add_metric(["CPU", lid, "ready"], lay.index.num_ready)
            blocks.add_metric(["CPU", lid, "reserved"], lay.index.num_reserved)
            blocks.add_metric(["CPU", lid, "pinned"], lay.index.num_pinned)
            cpu_bytes += lay.index.num_ready * lay.geometry.slot_bytes
        gpu = _gpu_blocks(store)
        blocks.add_metric(["GPU", "", "ready"], gpu)
        nbytes.add_metric(["CPU"], cpu_bytes)
        yield blocks
        yield nbytes
        yield _gauge("offloadd_capacity_bytes", "Arena capacity", store.config.capacity_bytes)
        yield _gauge("offloadd_arena_allocated_bytes", "Bytes of chunk files created",
                     store.layouts.allocated_bytes)
        yield _gauge("offloadd_log_offset", "Offset of the last appended log record",
                     store.metadata.head)
        yield _gauge("offloadd_engines", "Registered engines", len(store.engines))
        yield _gauge("offloadd_leases", "Open leases", len(store.leases.leases))
        yield _gauge("offloadd_reservations", "Open reservations", len(store.leases.reservations))
        yield _counter("offloadd_lookup_hits", "Blocks found by Lookup", store.hits)
        yield _counter("offloadd_lookup_misses", "Blocks not found by Lookup", store.misses)
        yield _counter("offloadd_evictions", "Blocks evicted from the CPU tier", store.evictions)
        batches = CounterMetricFamily(
            "offloadd_ingest_batches", "Ingested batches by outcome", labels=["status"]
        )
        for status, n in (("applied", ingest.num_applied), ("duplicate", ingest.num_duplicate),
                          ("resend", ingest.num_resend), ("rejected", ingest.num_rejected)):
            batches.add_metric([status], n)
        yield batches
        yield _counter("offloadd_ingest_events", "Applied engine events", ingest.num_events)


class _CheckpointCollector(Collector):
    def __init__(self, stats: CheckpointStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        yield _gauge("offloadd_log_length", "Records retained in the log", s.log_length)
        yield _gauge("offloadd_log_first_offset", "Offset of the oldest retained record",
                     s.first_offset)
        yield _gauge("offloadd_checkpoint_offset", "Offset of the newest complete checkpoint",
                     s.offset)
        yield _gauge("offloadd_checkpoint_age_seconds", "Age of the newest checkpoint (-1: none)",
                     time.time() - s.created_ts if s.created_ts else -1)
        yield _gauge("offloadd_checkpoint_bytes", "Size of the newest checkpoint's chunks",
                     s.num_bytes)
        yield _counter("offloadd_checkpoints_written", "Checkpoints written", s.num_written)
        yield _counter("offloadd_checkpoint_failures", "Checkpoint or trim attempts that failed",
                       s.num_failed)
        yield _counter("offloadd_log_trimmed_records", "Records trimmed from the log",
                       s.num_trimmed)


class _FleetCollector(Collector):
    def __init__(self, stats: FillStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        yield _counter("offloadd_fleet_fills", "Lookup misses filled from a peer's tier", s.num_fills)
        yield _counter("offloadd_fleet_blocks", "Blocks stored from peers' tiers", s.num_blocks)
        yield _counter("offloadd_fleet_read_failures", "Reads from peers that failed", s.num_failed)
        yield _counter("offloadd_fleet_rejected_blocks",
                       "Peer blocks refused (checksum, size or chain)", s.num_rejected)


def _gpu_blocks(store: HostStore) -> int:
    # Scrapes run on the HTTP thread while the event loop mutates the reducer's dicts; a
    # resize mid-iteration raises RuntimeError, and simply reading again is enough.
    for _ in range(5):
        try:
            return sum(n for (_, medium, _), n in store.state.counts().items() if medium == "GPU")
        except RuntimeError:
            continue
    return -1


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class DaemonMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rpc_latency = Histogram(
            "offloadd_rpc_seconds", "Server-side RPC latency", ["method", "code"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.ingest_lag = Histogram(
            "offloadd_ingest_lag_seconds", "Batch timestamp to durable apply",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )

        self._http: Any = None

    def watch(self, store: HostStore, ingest: Ingest) -> None:
        self.registry.register(_StateCollector(store, ingest))

    def watch_checkpoints(self, stats: CheckpointStats) -> None:
        self.registry.register(_CheckpointCollector(stats))

    def watch_fleet(self, stats: FillStats) -> None:
        self.registry.register(_FleetCollector(stats))

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP server in a thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return int(server.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
