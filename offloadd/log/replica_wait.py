"""Acknowledge a log write only once replicas have it: the write script, then ``WAIT n timeout``
on the same connection (one pipeline, one round trip more on the wire's worth of latency).

WAIT counts the replicas that acknowledged everything the *connection* wrote, so it must follow
the script on the connection that ran it: a standalone or Sentinel client pipelines both; a
Cluster client sends both to the node serving the namespace's slot (``target_nodes``), which
its pipeline runs on one connection. A write whose replicas did not all answer within the
timeout is in doubt (:class:`ReplicasBehind`, a RedisError: the writer reads it back later), so
an acknowledged append is on ``replicas`` replicas and survives a failover to one of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import ConnectionError, NoScriptError, RedisClusterException, RedisError

from rpc.redis_connect import is_cluster


class ReplicasBehind(RedisError):
    """The write ran on the primary but fewer replicas than asked acknowledged it in time."""


class WaitedScript:
    """Callable like the redis-py script it wraps: ``await script(keys=..., args=...)``."""

    def __init__(self, client: Any, script: Any, replicas: int, timeout_ms: int) -> None:
        self.client = client
        self.script = script
        self.replicas = replicas
        self.timeout_ms = timeout_ms
        self._is_cluster = is_cluster(client)

    async def __call__(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        for _ in range(2):
            pipe = self.client.pipeline(transaction=False)
            pipe.execute_command("EVALSHA", self.script.sha, len(keys), *keys, *args)
            target = {"target_nodes": await self._node_of(keys[0])} if self._is_cluster else {}
            pipe.execute_command("WAIT", self.replicas, self.timeout_ms, **target)
            reply, acked = await pipe.execute(raise_on_error=False)
            if isinstance(reply, NoScriptError):  # a new primary after a failover: load, again
                await self.client.script_load(self.script.script)
                continue
            if isinstance(reply, BaseException):
                raise reply
            if reply and reply[0] in (b"ok", "ok"):
                if isinstance(acked, BaseException):
                    raise acked
                if int(acked) < self.replicas:
                    raise ReplicasBehind(f"{acked} of {self.replicas} replicas acknowledged the "
                                         f"write within {self.timeout_ms} ms")
            return reply
        raise NoScriptError("the write script could not be loaded")

    async def _node_of(self, key: Any) -> Any:
        """The primary serving ``key``'s slot, after a topology refresh when one is due."""
        try:
            await self.client.initialize()  # a no-op unless a failure asked for a refresh
            return self.client.get_node_from_key(key)
        except RedisClusterException as exc:  # no node for the slot yet: nothing was sent
            raise ConnectionError(f"no primary serves the namespace's slot: {exc}") from exc
