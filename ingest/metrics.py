"""kv-ingest's Prometheus metrics and health, served as ``/metrics`` and ``/healthz``.

The HTTP side is a small ASGI app on rpc.http_server (uvicorn on a thread of its own).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

STALL_S = 10.0  # a follower loop silent this long makes kv-ingest unhealthy


class IngestMetrics:
    """One registry per process (no global collectors); label ``source`` is the log's source."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.batches = Counter("kvingest_batches", "Batches appended to offloadd's log", ["source"], registry=r)
        self.block_events = Counter("kvingest_block_events", "Block hashes in the batches appended",
                                    ["source"], registry=r)
        self.replayed = Counter("kvingest_replayed_batches", "Batches taken from a replay socket",
                                ["source"], registry=r)
        self.gaps = Counter("kvingest_gaps", "Seq gaps seen on a live stream", ["source"], registry=r)
        self.duplicates = Counter("kvingest_duplicates", "Batches seen twice (dropped)", ["source"],
                                  registry=r)
        self.resyncs = Counter("kvingest_resyncs", "Sources re-synced (cleared, then rebuilt)",
                               ["source", "reason"], registry=r)
        self.garbage = Counter("kvingest_garbage", "Frames or payloads that do not follow the wire",
                               ["source", "kind"], registry=r)
        self.skipped = Counter("kvingest_skipped_events", "Events of a medium without a tier in the log",
                               ["source"], registry=r)
        self.next_seq = Gauge("kvingest_next_seq", "Next seq expected from the publisher", ["source"],
                              registry=r)
        self.pending = Gauge("kvingest_pending", "Batches sent to offloadd and not yet acked",
                             ["source"], registry=r)


@dataclass
class FollowerHealth:
    beat: float = field(default_factory=time.monotonic)
    detail: str = "starting"
    offloadd_connected: bool | None = None  # None: nothing sent yet


@dataclass
class Health:
    """Written by the follower threads, read by the HTTP thread."""

    followers: dict[str, FollowerHealth] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def update(self, name: str, detail: str | None = None, connected: bool | None = None) -> None:
        with self.lock:
            h = self.followers.setdefault(name, FollowerHealth())
            h.beat = time.monotonic()
            if detail is not None:
                h.detail = detail
            if connected is not None:
                h.offloadd_connected = connected

    def report(self) -> tuple[bool, dict[str, Any]]:
        now = time.monotonic()
        with self.lock:
            out = {n: {"detail": h.detail, "loop_age_s": round(now - h.beat, 3),
                       "offloadd_connected": h.offloadd_connected}
                   for n, h in self.followers.items()}
            ok = bool(self.followers) and all(
                now - h.beat < STALL_S and h.offloadd_connected is not False
                for h in self.followers.values())
        return ok, {"status": "ok" if ok else "unavailable", "publishers": out}


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def http_app(metrics: IngestMetrics, health: Health) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The ASGI app: ``/metrics``, ``/healthz`` (200 or 503 with JSON), 404 otherwise."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope.get("path", "")
        if path == "/metrics":
            code, ctype, body = 200, CONTENT_TYPE_LATEST, generate_latest(metrics.registry)
        elif path in ("/healthz", "/health"):
            ok, info = health.report()
            code, ctype, body = (200 if ok else 503), "application/json", json.dumps(info).encode()
        else:
            code, ctype, body = 404, "application/json", b'{"detail": "not found"}'
        await send({"type": "http.response.start", "status": code,
                    "headers": [(b"content-type", ctype.encode()),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return app
