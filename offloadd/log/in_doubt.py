"""A write whose outcome is in doubt (its reply was lost: Redis died, the connection broke, the
replicas did not answer in time): read its records back to know whether it landed.

A write lands entirely or not at all (offloadd.log.write_script), so its records are in the log
exactly as the daemon encoded them with the head at the last one, or absent with the head where
the daemon left it. Anything else is not what the daemon wrote: a head below the daemon's is a
failover that lost acknowledged records (offloadd.log.failover ends that log), the rest a
conflict that stops the daemon.

With ``--redis-wait-replicas`` a write found on the primary has landed only once the replicas
have it too (``confirm``, offloadd.log.replica_wait): until then it stays in doubt and nothing
after it is written, so a primary without a replica in sync holds at most that one write more
than its replicas, and a failover to one of them only takes back what was never acknowledged
(DECISIONS 59).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from events.logkeys import LogKeys
from events.records import RECORD_FIELD, entry_id
from offloadd.log.append import Batch
from offloadd.log.failover import end_rewound_log
from offloadd.log.log_errors import LogConflict, RedisUnavailable

log = logging.getLogger(__name__)

# The replicas' confirmation of a head found on the primary (offloadd.log.replica_wait.confirm):
# True when they have it, False when the head moved meanwhile, a RedisError when they do not yet.
Confirm = Callable[[str, int], Awaitable[bool]]


async def read_back(client: Any, keys: LogKeys, batch: Batch, head: int, owner: str = "",
                    confirm: Confirm | None = None) -> bool:
    """True when ``batch`` (written at the daemon's ``head``) landed, False when nothing of it
    did; RedisUnavailable when Redis cannot tell yet (or, with ``confirm``, the replicas do not
    have it yet), LogConflict when the log holds neither."""
    first, last = batch[0][0].offset, batch[-1][0].offset
    try:
        found = await client.xrange(keys.log, entry_id(first), entry_id(last))
        head_now = int(await client.get(keys.head) or 0)
    except (RedisError, OSError) as exc:
        raise RedisUnavailable(f"Redis unreachable: {exc}") from exc
    if [fields.get(RECORD_FIELD) for _, fields in found] == [d for _, d, _ in batch] and head_now == last:
        if confirm is not None:
            await _replicated(confirm, keys, first, last)
        log.warning("write in doubt had landed; applying offsets %d..%d", first, last)
        return True
    if not found and head_now == head:
        return False
    if head_now < head:  # a failover lost acknowledged records too
        raise LogConflict(await end_rewound_log(client, keys, owner, head_now, head))
    raise LogConflict(f"log at offsets {first}..{last} is not what the daemon wrote (head {head_now})")


async def _replicated(confirm: Confirm, keys: LogKeys, first: int, last: int) -> None:
    """Returns once the replicas have offsets ``first..last``; RedisUnavailable until then."""
    try:
        if await confirm(keys.head, last):
            return
        why = "the log moved while it was read back"
    except (RedisError, OSError) as exc:
        why = str(exc)
    raise RedisUnavailable(f"write in doubt at offsets {first}..{last} is on the primary, not yet "
                           f"confirmed by its replicas ({why}); nothing more is written until it is")
