"""``kv-ingest`` entry point: config, one follower thread per vLLM publisher, signals.

SIGTERM (or SIGINT) stops the followers: each flushes what offloadd has not acked (up to 5 s)
and says goodbye, so the daemon clears the sources kv-ingest no longer follows. A restarted
kv-ingest re-syncs every source from its publisher's ring.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Sequence

import zmq

from events.replay_socket import connect
from ingest.config import IngestConfig, config_from_args
from ingest.errors import IngestConfigError
from ingest.follower import Follower
from ingest.metrics import Health, IngestMetrics, http_app
from offloadd.client import ClientSecurity
from rpc.http_server import ThreadedHttpServer
from rpc.signals import stop_on_signals

log = logging.getLogger("kvingest")


def security_of(config: IngestConfig) -> ClientSecurity:
    return ClientSecurity.from_files(ca_file=config.offloadd_ca_file or "",
                                     token_file=config.offloadd_token_file or "")


def check_endpoints(config: IngestConfig) -> None:
    """EndpointError for a publisher endpoint ZMQ refuses (``tcp://host`` without a port), before
    anything starts: a follower thread would otherwise die on it."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        for spec in config.sources:
            for endpoint in (spec.pub, spec.replay):
                if endpoint is not None:
                    sock = ctx.socket(zmq.DEALER)
                    try:
                        connect(sock, endpoint)
                    finally:
                        sock.close(linger=0)
    finally:
        ctx.term()


def run(config: IngestConfig, stop: threading.Event, metrics: IngestMetrics, health: Health) -> None:
    """Follow every publisher until ``stop`` is set; returns once every follower has stopped."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    security = security_of(config)
    followers = [Follower(spec, config, ctx, security, metrics, health) for spec in config.sources]
    threads = [threading.Thread(target=f.run, args=(stop,), name=f"follow-{f.label}", daemon=True)
               for f in followers]
    for t in threads:
        t.start()
    for f in followers:
        log.info("following %s at %s (replay %s, topic %r)", f.label, f.spec.pub,
                 f.spec.replay or "none", f.spec.topic)
    try:
        stop.wait()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=15)
        ctx.term()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = config_from_args(sys.argv[1:] if argv is None else argv, os.environ)
        security_of(config)  # unreadable CA or token files fail here, before anything starts
        check_endpoints(config)
    except (IngestConfigError, ValueError, OSError) as exc:
        print(f"kv-ingest: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    metrics, health = IngestMetrics(), Health()
    try:
        server = ThreadedHttpServer(http_app(metrics, health), config.metrics_host,
                                    config.metrics_port, grace_s=1.0).start()
    except OSError as exc:
        print(f"kv-ingest: error: cannot serve metrics on port {config.metrics_port}: {exc}",
              file=sys.stderr)
        return 2
    log.info("metrics and health on port %d", server.port)
    stop = stop_on_signals(log)
    try:
        run(config, stop, metrics, health)
    finally:
        server.stop(timeout_s=2.0)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
