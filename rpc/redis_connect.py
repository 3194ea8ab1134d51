"""The one way every kvoffload process builds a Redis client from a URL (DESIGN.md 3.10).

URL forms:

- ``redis://[user:pass@]host:port/db``, ``rediss://...`` (TLS), ``unix:///path.sock``: one
  standalone Redis, as ``redis.Redis.from_url`` reads it.
- ``redis+cluster://[user:pass@]host:port[,host:port...]`` (``rediss+cluster://`` for TLS), or
  ``redis://`` with more than one ``host:port``: a Redis Cluster, the listed nodes as seeds
  (redis-py's cluster client finds the rest and follows failovers). db must be 0.
- ``redis+sentinel://[user:pass@]host:port[,host:port...]/service[/db]``
  (``rediss+sentinel://``): the primary Sentinel names ``service``; credentials are the
  primary's; ``?sentinel_password=`` the sentinels' own.

Query-string options (``?socket_timeout=2``...) are passed on as redis-py's ``from_url`` does.
A URL that is none of these raises ValueError naming the forms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.cluster import ClusterNode
from redis.connection import parse_url

from rpc.logs import redact_url

FORMS = ("redis://host:port/db, rediss://..., unix:///path, "
         "redis+cluster://host:port[,host:port...], "
         "redis+sentinel://host:port[,host:port...]/service[/db]")

TRANSIENT: tuple[type[BaseException], ...] = (
    redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError, redis.exceptions.SlotNotCoveredError,
    redis.exceptions.ReadOnlyError, OSError,
)
"""Errors that mean "Redis is not reachable right now" (a node down, a failover under way, an
old primary turned replica): safe to retry a read after; a write's outcome is in doubt."""


@dataclass(frozen=True)
class RedisTarget:
    """What a URL names: ``kind`` is "standalone", "cluster" or "sentinel"."""

    kind: str
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    service: str = ""
    options: dict[str, Any] = field(default_factory=dict)  # credentials, db, ssl, query options

    def describe(self) -> str:
        """The URL without its password, for messages and logs."""
        return redact_url(self.url)


def parse(url: str) -> RedisTarget:
    """Which Redis deployment ``url`` names; ValueError for anything else."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    base, _, mode = scheme.partition("+")
    if base not in ("redis", "rediss", "unix") or mode not in ("", "cluster", "sentinel"):
        raise ValueError(f"not a Redis URL: {_safe(url)!r}; use one of {FORMS}")
    hosts = parts.netloc.rsplit("@", 1)[-1]
    if base == "unix" or (not mode and "," not in hosts):
        parse_url(url)  # raises ValueError on a bad port, db or option
        return RedisTarget("standalone", url)
    nodes = tuple(_host_port(h, 26379 if mode == "sentinel" else 6379, url)
                  for h in hosts.split(","))
    path = [p for p in parts.path.split("/") if p]
    service = ""
    if mode == "sentinel":
        if not path:
            raise ValueError(f"a sentinel URL names its service: {_safe(url)!r} "
                             f"(redis+sentinel://host:port/service[/db])")
        service, path = unquote(path[0]), path[1:]
    creds = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    single = parts._replace(scheme=base, netloc=creds + hosts.split(",")[0], path="/" + "/".join(path))
    options = parse_url(single.geturl())  # credentials, db, ssl and query options, cast
    for k in ("host", "port"):
        options.pop(k, None)
    if mode != "sentinel" and int(options.get("db") or 0) != 0:
        raise ValueError(f"a Redis Cluster has only db 0: {_safe(url)!r}")
    return RedisTarget("sentinel" if mode == "sentinel" else "cluster", url, nodes, service, options)


def _host_port(text: str, default_port: int, url: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":") if not text.endswith("]") else (text, "", "")
    if not sep:
        host, port = text, str(default_port)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad host:port {text!r} in {_safe(url)!r}")
    return host.strip("[]"), int(port)


def _safe(url: str) -> str:
    return redact_url(url)


def _split(options: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Connection kwargs: the URL's options over the caller's (as from_url does)."""
    merged = {**kwargs, **options}
    if merged.pop("connection_class", None) is not None:
        merged["ssl"] = True
    return merged


@dataclass(frozen=True)
class _Flavor:
    """redis-py's classes for one kind of client (blocking or asyncio)."""

    redis: Any
    cluster: Any
    cluster_node: Any
    sentinel: Any


_BLOCKING = _Flavor(redis.Redis, redis.RedisCluster, ClusterNode, redis.sentinel.Sentinel)
_ASYNC = _Flavor(aioredis.Redis, aioredis.RedisCluster, AsyncClusterNode, aiosentinel.Sentinel)


def connect(url: str, **kwargs: Any) -> Any:
    """A blocking client for ``url``: ``redis.Redis`` or ``redis.RedisCluster``.
    ``kwargs`` are connection options (socket_timeout, retry...), given to every node."""
    return _connect(_BLOCKING, url, kwargs)


def connect_async(url: str, **kwargs: Any) -> Any:
    """An asyncio client for ``url``: ``redis.asyncio.Redis`` or ``redis.asyncio.RedisCluster``."""
    return _connect(_ASYNC, url, kwargs)


def _connect(flavor: _Flavor, url: str, kwargs: dict[str, Any]) -> Any:
    target = parse(url)
    if target.kind == "standalone":
        return flavor.redis.from_url(url, **kwargs)
    opts = _split(target.options, kwargs)
    if target.kind == "cluster":
        opts.pop("db", None)
        opts.pop("health_check_interval", None)
        return flavor.cluster(startup_nodes=[flavor.cluster_node(h, p) for h, p in target.nodes], **opts)
    return _sentinel(flavor.sentinel, flavor.redis, target, opts)


def _sentinel(sentinel_cls: Any, client_cls: Any, target: RedisTarget, opts: dict[str, Any]) -> Any:
    sentinel_kwargs: dict[str, Any] = {k: opts[k] for k in ("socket_timeout", "socket_connect_timeout", "ssl")
                       if k in opts}
    if "sentinel_password" in opts:
        sentinel_kwargs["password"] = opts.pop("sentinel_password")
    sentinels = sentinel_cls(list(target.nodes), sentinel_kwargs=sentinel_kwargs)
    return sentinels.master_for(target.service, redis_class=client_cls, **opts)


def is_cluster(client: Any) -> bool:
    return isinstance(client, (redis.RedisCluster, aioredis.RedisCluster))


def client_url(client: Any) -> str:
    """A URL (no password) that reaches what ``client`` is connected to, for messages."""
    if is_cluster(client):
        nodes = client.get_nodes() or getattr(client, "startup_nodes", [])
        return "redis+cluster://" + ",".join(f"{n.host}:{n.port}" for n in nodes)
    pool = client.connection_pool
    manager = getattr(pool, "sentinel_manager", None)
    if manager is not None:
        hosts = ",".join(f"{kw.get('host')}:{kw.get('port')}" for kw in
                         (s.connection_pool.connection_kwargs for s in manager.sentinels))
        return f"redis+sentinel://{hosts}/{pool.service_name}"
    kw = pool.connection_kwargs
    if "path" in kw:
        return f"unix://{kw['path']}"
    return f"redis://{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"
