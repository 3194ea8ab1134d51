"""``offloadd``: the per-node offload daemon. Flags and KVD_* environment, see offloadd.config."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from offloadd.config import ConfigError, OffloaddConfig, load_config
from offloadd.logs import setup_logging
from offloadd.metadata import RedisUnavailable
from offloadd.server import create_server

log = logging.getLogger("offloadd")


async def serve(config: OffloaddConfig) -> int:
    daemon, ports = await create_server(config)
    log.info("serving", extra={
        "grpc_port": ports.grpc_port, "metrics_port": ports.metrics_port,
        "unix_socket": ports.unix_socket, "namespace": config.namespace,
        "recovery": daemon.recovery.__dict__ if daemon.recovery else None,
    })
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    _done, _ = await asyncio.wait(
        [asyncio.create_task(stop.wait()), asyncio.create_task(daemon.fatal.wait())],
        return_when=asyncio.FIRST_COMPLETED,
    )
    for task in _:
        task.cancel()
    log.info("stopping", extra={"fatal": daemon.fatal_reason})
    await daemon.stop()
    return 3 if daemon.fatal.is_set() else 0


def _run(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # uvloop is Linux/macOS only
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(argv, os.environ)
    except ConfigError as exc:
        print(f"offloadd: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level)
    try:
        return _run(serve(config))
    except RedisUnavailable as exc:
        log.error("cannot start: %s", exc)
        return 1
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
