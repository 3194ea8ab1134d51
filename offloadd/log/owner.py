"""One owner per namespace (DESIGN.md 3.5): a Redis lease with a fencing token.

``kvd:{ns}:owner`` holds ``"{token}:{daemon_id}:{process}"`` with a TTL of the lease; the
token comes from ``INCR kvd:{ns}:owner-token``, so every owner gets a larger one. The daemon
acquires it before reading any state, renews it every lease/3 with a compare-and-set, and
releases it on a graceful stop. The lease alone does not make a paused daemon harmless: every
write of the log checks the owner value on the Redis side in the same script that writes
(offloadd.log.metadata), so a daemon that lost the lease cannot write.

A held lease is waited out only when its holder is provably gone: a process on this very host
and pid namespace that no longer runs, or is a zombie (a kill -9 restart need not wait for the
TTL). A holder
that keeps renewing is a live daemon: the newcomer refuses to start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from events.logkeys import LogKeys
from offloadd.errors import ForeignData, NamespaceOwned
from offloadd.log.metadata import OwnershipLost, RedisUnavailable

log = logging.getLogger(__name__)

# KEYS: owner, token counter. ARGV: daemon id + process mark, lease ms, value seen as dead ('').
_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[3] then return {0, cur, redis.call('PTTL', KEYS[1])} end
local token = redis.call('INCR', KEYS[2])
local value = token .. ':' .. ARGV[1]
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return {1, value, token}
"""
# KEYS: owner. ARGV: our value, lease ms (renew) or '' (release).
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def _process_mark(pid: int) -> str:
    """Boot id, pid namespace, pid and start time: equal only for the same live process."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = "?"
    start = _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
    started = start[19] if len(start) > 19 and not _is_dead(pid) else "?"
    return f"{_read('/proc/sys/kernel/random/boot_id')}/{pidns}/{pid}/{started}"


def _is_dead(pid: int) -> bool:
    """Every thread of ``pid`` has exited: a zombie that its parent has not reaped yet (a kill -9
    under a parent that does not wait, such as a profiler or a container's init) runs no code,
    though /proc still shows its start time."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tasks:
        state = _read(f"/proc/{pid}/task/{tid}/stat").rsplit(")", 1)[-1].split()[:1]
        if state and state[0] not in ("Z", "X", "?"):  # '?': unreadable, exited meanwhile
            return False
    return True


def _is_gone(value: str) -> bool:
    """The holder ran on this host and pid namespace and that process no longer runs."""
    mark = value.split(":", 2)[-1]
    parts = mark.split("/")
    if len(parts) != 4 or "?" in parts or not parts[2].isdigit():
        return False
    ours = _process_mark(os.getpid()).split("/")
    if parts[:2] != ours[:2]:
        return False  # another host or container: only its TTL tells
    return _process_mark(int(parts[2])) != mark


class OwnerLease:
    """The namespace's owner lease: ``acquire`` at start, ``keep`` renewing, ``release`` at stop."""

    def __init__(self, client: Any, keys: LogKeys, lease_s: float) -> None:
        self.client = client
        self.keys = keys
        self.lease_ms = max(1, int(lease_s * 1000))
        self.identity = f"{uuid.uuid4().hex[:12]}:{_process_mark(os.getpid())}"
        self.value = ""
        self.token = 0
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._retaking = asyncio.Lock()

    async def acquire(self) -> str:
        """Take the lease or raise NamespaceOwned; returns the owner value writes are fenced by."""
        k = self.keys
        try:
            kind = (await self.client.type(k.owner)).decode()
            if kind not in ("none", "string"):
                raise ForeignData(f"key {k.owner} is a {kind}, not the owner lease (a string)")
            dead = ""
            cur = await self.client.get(k.owner)
            if cur is not None and _is_gone(cur.decode(errors="replace")):
                dead = cur.decode(errors="replace")
                log.warning("owner lease of %s held by a process that is gone; taking it", k.namespace)
            ok, value, extra = await self._acquire(
                keys=[k.owner, k.owner_token], args=[self.identity, self.lease_ms, dead])
        except RedisError as exc:
            raise RedisUnavailable(f"Redis unreachable while taking the owner lease: {exc}") from exc
        if not ok:
            token = value.decode(errors="replace").split(":", 1)[0]
            expires = f"{extra / 1000:.1f} s" if extra >= 0 else "never (no TTL)"
            raise NamespaceOwned(
                f"namespace {k.namespace!r} is owned by another daemon (token {token}, lease "
                f"expires in {expires}); stop it or wait")
        self.value, self.token = value.decode(), int(extra)
        log.info("owner of namespace %s", k.namespace, extra={"owner_token": self.token})
        return self.value

    async def renew(self) -> bool:
        """Extend the lease: True. False when it ran out with nobody taking it (Redis was out of
        reach past its TTL, or restarted): :meth:`retake` it. OwnershipLost when another holds it."""
        try:
            if await self._renew(keys=[self.keys.owner], args=[self.value, self.lease_ms]):
                return True
            cur = await self.client.get(self.keys.owner)
        except RedisError as exc:
            raise RedisUnavailable(f"Redis unreachable renewing the owner lease: {exc}") from exc
        if cur is None:
            return False
        raise OwnershipLost(f"lost the owner lease of namespace {self.keys.namespace!r} "
                            f"(token {self.token}): another daemon owns it now")

    async def retake(self) -> str:
        """Take the lease again after it ran out with nobody taking it, with a larger token.
        Safe: a write another owner made meanwhile moved the log head, which every write of
        ours checks too. OwnershipLost when another daemon took it first."""
        async with self._retaking:
            try:
                cur = await self.client.get(self.keys.owner)
                if cur is not None and cur.decode(errors="replace") == self.value:
                    return self.value  # retaken already (by a write, or the renewal)
                ok, value, extra = await self._acquire(
                    keys=[self.keys.owner, self.keys.owner_token],
                    args=[self.identity, self.lease_ms, ""])
            except RedisError as exc:
                raise RedisUnavailable(f"Redis unreachable retaking the owner lease: {exc}") from exc
            if not ok:
                raise OwnershipLost(f"lost the owner lease of namespace {self.keys.namespace!r} "
                                    f"(token {self.token}): another daemon took it")
            log.warning("owner lease of %s had run out; retaken with token %d (was %d)",
                        self.keys.namespace, int(extra), self.token)
            self.value, self.token = value.decode(), int(extra)
            return self.value

    async def keep(self, on_lost: Callable[[str], None],
                   refence: Callable[[], Awaitable[None]]) -> None:
        """Renew every lease/3 until cancelled; call ``on_lost(reason)`` once it is lost. A
        renewal that cannot reach Redis is retried within 0.2 s (an outage eats the TTL); a
        lease that ran out with nobody taking it is retaken through ``refence`` (the writer
        swaps the value its writes are fenced by, under its lock)."""
        interval = self.lease_ms / 3000
        delay = interval
        while True:
            await asyncio.sleep(delay)
            t0 = time.monotonic()
            try:
                if not await self.renew():
                    await refence()
                delay = interval
            except RedisUnavailable as exc:
                log.warning("%s", exc)
                delay = min(0.2, interval)
            except OwnershipLost as exc:
                on_lost(str(exc))
                return
            if time.monotonic() - t0 > interval:
                log.warning("owner lease renewal took %.1f s", time.monotonic() - t0)

    async def release(self) -> None:
        """Give the lease back (only if still ours); errors are logged, the TTL ends it anyway."""
        if not self.value:
            return
        try:
            await self._renew(keys=[self.keys.owner], args=[self.value, ""])
        except (RedisError, OSError) as exc:
            log.warning("owner lease not released (it expires in %d ms): %s", self.lease_ms, exc)
        self.value = ""
