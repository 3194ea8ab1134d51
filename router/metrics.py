"""Prometheus metrics of kv-router, read at scrape time from the router (no module registry)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from router.service import Router


class RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        r = self.router
        t = r.truth
        decisions = CounterMetricFamily("kv_router_decisions", "Routing decisions by reason and engine",
                                        labels=["reason", "engine"])
        for (reason, engine), n in sorted(t.decisions_by_reason.items()):
            decisions.add_metric([reason, engine], n)
        yield decisions
        outcomes = CounterMetricFamily("kv_router_predictions",
                                       "Requests by prediction outcome (agree, event_lag, hash_mismatch, eviction_race, "
                                       "eviction_overestimate)",
                                       labels=["outcome"])
        for outcome, n in t.outcomes.items():
            outcomes.add_metric([outcome], n)
        yield outcomes
        yield GaugeMetricFamily("kv_router_prediction_agreement", "Share of requests predicted exactly",
                                value=t.agreement)
        yield CounterMetricFamily("kv_router_predicted_cached_tokens", "Cached prompt tokens predicted",
                                  value=t.predicted_tokens)
        yield CounterMetricFamily("kv_router_reported_cached_tokens", "Cached prompt tokens the engines reported",
                                  value=t.reported_tokens)
        yield CounterMetricFamily("kv_router_retries", "Requests sent again to another engine", value=r.retries)
        yield SummaryMetricFamily("kv_router_decision_seconds", "Tokenize + hash + choose, per request",
                                  count_value=r.timings.count, sum_value=r.timings.total_s)
        in_flight = GaugeMetricFamily("kv_router_engine_in_flight", "Requests in flight per engine", labels=["engine"])
        healthy = GaugeMetricFamily("kv_router_engine_healthy", "1 while the engine is in rotation", labels=["engine"])
        served = CounterMetricFamily("kv_router_engine_requests", "Requests completed per engine", labels=["engine"])
        hits = CounterMetricFamily("kv_router_engine_cached_tokens", "Cached prompt tokens reported, by tier",
                                   labels=["engine", "tier"])
        for e in r.fleet.engines:
            in_flight.add_metric([e.name], e.in_flight)
            healthy.add_metric([e.name], 1 if e.healthy else 0)
            served.add_metric([e.name], e.requests)
            hits.add_metric([e.name, "GPU"], e.gpu_hit_tokens)
            hits.add_metric([e.name, "CPU"], e.cpu_hit_tokens)
        yield from (in_flight, healthy, served, hits)
        if r.follower is not None:
            yield GaugeMetricFamily("kv_router_event_rate", "Block events per second seen on the bridge",
                                    value=r.follower.event_rate())
