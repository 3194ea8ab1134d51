"""``kv-bridge`` entry point: builds the config, the Redis client and the bridge; handles signals.

This is the one place of the bridge that imports redis (DESIGN.md 5): the library modules take
the client and the "Redis is down" exception types from here.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

import redis
import zmq

from bridge.bootstrap import CheckpointReader
from bridge.config import BridgeConfig, config_from_args
from bridge.metrics import BridgeMetrics, Health, MetricsServer
from bridge.position import PositionStore
from bridge.publisher import Bridge
from events.logreader import LogReader
from rpc.redis_connect import TRANSIENT, connect
from rpc.signals import stop_on_signals

REDIS_TRANSIENT: tuple[type[BaseException], ...] = (*TRANSIENT, redis.BusyLoadingError)

log = logging.getLogger("kvbridge")


def build(config: BridgeConfig, ctx: zmq.Context[zmq.Socket[bytes]]) -> Bridge:
    client = connect(
        config.redis_url, socket_connect_timeout=2.0, socket_timeout=5.0, health_check_interval=10
    )
    reader = LogReader(client, config.keys, REDIS_TRANSIENT)
    positions = PositionStore(
        client, config.keys.bridge(config.name), REDIS_TRANSIENT, epoch_key=config.keys.epoch
    )
    checkpoints = CheckpointReader(client, config.keys, REDIS_TRANSIENT)
    return Bridge(config, reader, positions, ctx, BridgeMetrics(), Health(), checkpoints)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = config_from_args(sys.argv[1:] if argv is None else argv, os.environ)
    except ValueError as exc:
        print(f"kv-bridge: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        bridge = build(config, ctx)
        server = MetricsServer(config.metrics_host, config.metrics_port, bridge.metrics, bridge.health)
    except (zmq.ZMQError, OSError) as exc:
        print(f"kv-bridge: error: cannot bind: {exc}", file=sys.stderr)
        ctx.destroy(linger=0)  # a socket bound before the failing one is still open
        return 2
    server.start()
    log.info("metrics and health on port %d", server.port)
    stop = stop_on_signals(log)
    try:
        bridge.run(stop)
    finally:
        server.stop()
        ctx.term()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
