"""The bridge's Prometheus metrics and its small HTTP server for ``/metrics`` and ``/healthz``."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)


@dataclass
class Health:
    """What ``/healthz`` reports; written by the bridge loop, read by the HTTP thread."""

    redis_ok: bool = False
    ready: bool = False
    detail: str = "starting"
    last_loop_monotonic: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, *, redis_ok: bool, detail: str, ready: bool | None = None) -> None:
        with self.lock:
            self.redis_ok = redis_ok
            self.detail = detail
            if ready is not None:
                self.ready = ready
            self.last_loop_monotonic = time.monotonic()

    def beat(self) -> None:
        with self.lock:
            self.last_loop_monotonic = time.monotonic()

    def report(self, stall_s: float = 10.0) -> tuple[bool, dict[str, Any]]:
        with self.lock:
            age = time.monotonic() - self.last_loop_monotonic
            ok = self.redis_ok and self.ready and age < stall_s
            return ok, {
                "status": "ok" if ok else "unavailable",
                "redis": "up" if self.redis_ok else "down",
                "ready": self.ready,
                "detail": self.detail,
                "loop_age_s": round(age, 3),
            }


class BridgeMetrics:
    """One registry per bridge (no process-global collectors, so tests can run several)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.published_batches = Counter(
            "kvbridge_published_batches", "Batches published on the PUB socket", ["topic"], registry=r
        )
        self.published_events = Counter(
            "kvbridge_published_events", "Events published on the PUB socket", registry=r
        )
        self.records_read = Counter("kvbridge_records_read", "Log records read and applied", registry=r)
        self.requests = Counter(
            "kvbridge_replay_requests", "Replay socket requests", ["kind"], registry=r
        )
        self.replayed_batches = Counter(
            "kvbridge_replayed_batches", "Batches sent on the replay socket", registry=r
        )
        self.redis_errors = Counter("kvbridge_redis_errors", "Failed Redis calls", registry=r)
        self.violations = Counter(
            "kvbridge_state_violations", "Records the reducer flagged", registry=r
        )
        self.redis_up = Gauge("kvbridge_redis_up", "1 when the last Redis call succeeded", registry=r)
        self.offset = Gauge("kvbridge_log_offset", "Offset of the last published log record", registry=r)
        self.head = Gauge("kvbridge_log_head", "Head offset of the log at the last read", registry=r)
        self.pending = Gauge(
            "kvbridge_pending_apply", "Published records not yet applied to the state", registry=r
        )
        self.next_seq = Gauge("kvbridge_next_seq", "Next seq to publish", ["topic"], registry=r)


class _Handler(BaseHTTPRequestHandler):
    server: _MetricsHTTPServer

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body = generate_latest(self.server.metrics.registry)
            self._send(200, CONTENT_TYPE_LATEST, body)
        elif path in ("/healthz", "/health"):
            ok, info = self.server.health.report()
            self._send(200 if ok else 503, "application/json", json.dumps(info).encode())
        else:
            self._send(404, "text/plain", b"not found\n")

    def _send(self, code: int, ctype: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return  # scrapes every few seconds would flood the log


class _MetricsHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], metrics: BridgeMetrics, health: Health) -> None:
        self.metrics = metrics
        self.health = health
        super().__init__(addr, _Handler)


class MetricsServer:
    """Serves ``/metrics`` and ``/healthz`` on a background thread until :meth:`stop`."""

    def __init__(self, host: str, port: int, metrics: BridgeMetrics, health: Health) -> None:
        self._server = _MetricsHTTPServer((host, port), metrics, health)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvbridge-metrics", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
