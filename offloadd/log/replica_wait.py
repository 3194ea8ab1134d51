"""Acknowledge a log write only once replicas have it: the write script, then ``WAIT n timeout``
on the same connection (one pipeline, one round trip more on the wire's worth of latency).

WAIT counts the replicas that acknowledged everything the *connection* wrote, so it must follow
the script on the connection that ran it: a standalone or Sentinel client pipelines both; a
Cluster client sends both to the node serving the namespace's slot (``target_nodes``), which
its pipeline runs on one connection. A write whose replicas did not all answer within the
timeout is in doubt (:class:`ReplicasBehind`, a RedisError: the writer reads it back later), so
an acknowledged append is on ``replicas`` replicas and survives a failover to one of them.

A write in doubt that the read-back finds on the primary has landed only once the replicas have
it too (:meth:`WaitedScript.confirm`): a connection that wrote nothing cannot WAIT for another
connection's write, so the confirmation writes the head back unchanged (``TOUCH``, a replicated
no-op after everything the read-back saw) and waits for that (DECISIONS 59).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import ConnectionError, NoScriptError, RedisClusterException, RedisError

from rpc.redis_connect import is_cluster

# KEYS: head. ARGV: the head the read-back found. Writes it back (replicated) while it is still
# that; 0 when it moved (nothing written).
TOUCH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""


class ReplicasBehind(RedisError):
    """The write ran on the primary but fewer replicas than asked acknowledged it in time."""


class WaitedScript:
    """Callable like the redis-py script it wraps: ``await script(keys=..., args=...)``."""

    def __init__(self, client: Any, script: Any, replicas: int, timeout_ms: int) -> None:
        self.client = client
        self.script = script
        self.replicas = replicas
        self.timeout_ms = timeout_ms
        self._touch = client.register_script(TOUCH)
        self._is_cluster = is_cluster(client)

    async def __call__(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        reply, acked = await self._waited(self.script, keys, args)
        if reply and reply[0] in (b"ok", "ok"):
            self._check(acked, "the write")
        return reply

    async def confirm(self, head_key: str, head: int) -> bool:
        """Once the log's head is ``head`` on the primary: True when ``replicas`` replicas have
        everything up to it, False when the head moved meanwhile; ReplicasBehind when they did
        not acknowledge it within the timeout, another RedisError when Redis cannot tell."""
        reply, acked = await self._waited(self._touch, [head_key], [str(head)])
        if not reply:
            return False
        self._check(acked, f"offset {head}")
        return True

    def _check(self, acked: Any, what: str) -> None:
        if isinstance(acked, BaseException):
            raise acked
        if int(acked) < self.replicas:
            raise ReplicasBehind(f"{acked} of {self.replicas} replicas acknowledged {what} "
                                 f"within {self.timeout_ms} ms")

    async def _waited(self, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> tuple[Any, Any]:
        """``script``'s reply and WAIT's (a count, or the exception it raised)."""
        for _ in range(2):
            pipe = self.client.pipeline(transaction=False)
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            target = {"target_nodes": await self._node_of(keys[0])} if self._is_cluster else {}
            pipe.execute_command("WAIT", self.replicas, self.timeout_ms, **target)
            reply, acked = await pipe.execute(raise_on_error=False)
            if isinstance(reply, NoScriptError):  # a new primary after a failover: load, again
                await self.client.script_load(script.script)
                continue
            if isinstance(reply, BaseException):
                raise reply
            return reply, acked
        raise NoScriptError("the write script could not be loaded")

    async def _node_of(self, key: Any) -> Any:
        """The primary serving ``key``'s slot, after a topology refresh when one is due."""
        try:
            await self.client.initialize()  # a no-op unless a failure asked for a refresh
            return self.client.get_node_from_key(key)
        except RedisClusterException as exc:  # no node for the slot yet: nothing was sent
            raise ConnectionError(f"no primary serves the namespace's slot: {exc}") from exc
