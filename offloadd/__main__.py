"""``offloadd``: the per-node offload daemon. Flags and KVD_* environment, see offloadd.config."""

from __future__ import annotations

import gc

# The imports below make ~0.35 s of a restart's time to SERVING and allocate a few hundred
# thousand objects that live as long as the process: the cyclic collector, run every 700
# allocations, would only rescan them (~10% of that time). Off while they load, on again at the
# end of this module (recovery then freezes them with the state it rebuilt).
_collecting = gc.isenabled()
gc.disable()

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Coroutine, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.exceptions

from offloadd.config import ConfigError, OffloaddConfig, load_config
from offloadd.edge.server import create_server
from offloadd.errors import ForeignData, NamespaceOwned
from offloadd.log.metadata import LogConflict, RedisUnavailable
from rpc.logs import redact_url, setup_logging, url_secrets
from rpc.tls import SecurityConfigError, read_token

log = logging.getLogger("offloadd")
if _collecting:
    gc.enable()


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


def _redis_refusal(exc: BaseException, url: str) -> str | None:
    """A clear message when Redis refused our credentials or ACL (redis-py's own is obscure:
    "HELLO must be called with the client already authenticated ...")."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, redis.AuthenticationError):
            user = urlsplit(url).username or "default"
            return (f"Redis refused to authenticate user {unquote(user)!r} ({cause}); put the "
                    f"password, and the ACL user if any, in the Redis URL: "
                    f"redis://USER:PASSWORD@HOST:PORT/DB (now {redact_url(url)})")
        if isinstance(cause, redis.exceptions.NoPermissionError):
            return (f"the Redis ACL user lacks a permission ({cause}); it needs the keys "
                    f"'kvd:*' and the commands of +@all -@dangerous (SECURITY.md)")
        cause = cause.__cause__ or cause.__context__
    return None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(argv, os.environ)
    except ConfigError as exc:
        print(f"offloadd: {exc}", file=sys.stderr)
        return 2
    try:
        # Read here only to mask it in the logs (and refuse a bad file early); the daemon reads
        # it again, and warns about a loose mode once logging is set up.
        token = read_token(config.auth_token_file, warn=False) if config.auth_token_file else ""
    except SecurityConfigError as exc:
        print(f"offloadd: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, secrets=(token, *url_secrets(config.redis_url)))
    try:
        return _run(serve(config))
    except SecurityConfigError as exc:
        log.error("cannot start: %s", exc)
        return 2
    except (NamespaceOwned, ForeignData, LogConflict) as exc:
        # One line that says what and how to fix it: no traceback, whatever the log format.
        print(f"offloadd: {exc}", file=sys.stderr)
        return 1
    except (RedisUnavailable, redis.RedisError) as exc:
        # Recovery also calls Redis directly: an ACL refusal there arrives as a raw RedisError.
        log.error("cannot start: %s", _redis_refusal(exc, config.redis_url) or exc)
        return 1
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
