"""Prometheus metrics of the engine, read at scrape time from the engine and its event sink.

A collector on a registry the entry point creates (no module-level registry), so tests and
several engines in one process never share state.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.engine_loop import EngineLoop
from engine.ingest_sink import IngestEventSink


class EngineCollector(Collector):
    def __init__(self, loop: EngineLoop, sink: IngestEventSink | None) -> None:
        self.loop = loop
        self.sink = sink

    def collect(self) -> Iterator[Metric]:
        core = self.loop.core
        # kv_engine_info{engine_id="..."} 1: which engine this is, to join with offloadd's and the log's view
        yield InfoMetricFamily("kv_engine", "This engine's identity", value={"engine_id": core.config.engine_id})
        yield CounterMetricFamily("kv_engine_steps", "Engine steps run", value=self.loop.num_steps)
        yield GaugeMetricFamily("kv_engine_requests_running", "Requests running", value=len(core.scheduler.running))
        yield GaugeMetricFamily("kv_engine_requests_waiting", "Requests waiting", value=len(core.scheduler.waiting))
        yield CounterMetricFamily("kv_engine_preemptions", "Requests preempted", value=core.scheduler.num_preemptions)
        free = GaugeMetricFamily("kv_engine_kv_free_blocks", "Free KV blocks per group", labels=["group"])
        for pool in core.kv.pools:
            free.add_metric([str(pool.group_idx)], pool.num_free_blocks)
        yield free
        if self.sink is None:
            return
        s = self.sink
        yield GaugeMetricFamily("kv_engine_offloadd_connected", "1 when the event stream to offloadd is up",
                                value=1 if s.is_connected else 0)
        yield GaugeMetricFamily("kv_engine_events_unacked_batches", "Event batches not yet acked by offloadd",
                                value=s.num_pending)
        yield GaugeMetricFamily("kv_engine_events_unacked_capacity", "Most unacked batches kept", value=s.max_pending)
        yield CounterMetricFamily("kv_engine_event_batches_published", "Event batches handed to the stream",
                                  value=s.num_published)
        yield CounterMetricFamily("kv_engine_event_stream_resets",
                                  "New incarnations after a full queue or a rejected batch", value=s.stream.num_resets)
        yield CounterMetricFamily("kv_engine_event_batches_dropped", "Unacked batches dropped by resets",
                                  value=s.stream.num_dropped)
        yield CounterMetricFamily("kv_engine_event_stream_reconnects", "Reconnects of the event stream",
                                  value=s.stream.num_reconnects)
        yield CounterMetricFamily("kv_engine_events_oversize", "KV events (single blocks) left out: too big "
                                  "for one gRPC message even alone", value=s.stream.num_oversize)
