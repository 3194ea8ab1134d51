"""A log that went back: what a Redis failover with asynchronous replication loses, made loud.

A primary acknowledges a write before its replica has it. When it dies, the replica promoted in
its place may lack the newest records (and their projection: one script, replicated whole or not
at all). The daemon notices at its next write or read-back: the log's head in Redis is below the
last offset it wrote. Readers (bridges, kvctl, engines' acks) may have seen the lost records,
and the offsets would be reused by different ones, so the log as it stands is not the log they
followed. The daemon therefore ends it: one script, fenced by the owner lease and by the head it
found, deletes the log, the head, the epoch, the fences and the checkpoint pointer; the daemon stops (crash-only), and
its restart finds the log gone and starts a new epoch (offloadd.log.recovery), which every reader
checks: engines re-announce their GPU tiers, bridges tell subscribers with clears. The CPU tier
is dropped (its records are gone) and refilled by later stores: a cache costs a recompute, never
a wrong block. ``--redis-wait-replicas`` (offloadd.log.replica_wait) avoids the loss for every
acknowledged write.
"""

from __future__ import annotations

import logging
from typing import Any

from redis.exceptions import RedisError

from events.logkeys import LogKeys

log = logging.getLogger(__name__)

# KEYS: owner, head, log, checkpoint pointer, epoch, sources. ARGV: owner value ('' = unchecked), head found.
_END = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return 'owner' end
if (redis.call('GET', KEYS[2]) or '0') ~= ARGV[2] then return 'moved' end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
return 'ended'
"""


async def end_rewound_log(client: Any, keys: LogKeys, owner: str, found: int, wrote: int) -> str:
    """End the log that went back from ``wrote`` to ``found``; the reason, for on_fatal."""
    what = (f"log {keys.log} went back from offset {wrote} to {found}: a Redis failover lost the "
            f"newest records (asynchronous replication)")
    try:
        outcome = await client.eval(_END, 6, keys.owner, keys.head, keys.log, keys.checkpoint,
                                    keys.epoch, keys.sources, owner, str(found))
    except RedisError as exc:
        log.error("%s; ending it failed (%s)", what, exc)
        return f"{what}; not ended: {exc}"
    outcome = outcome.decode() if isinstance(outcome, bytes) else str(outcome)
    if outcome != "ended":
        return f"{what}; left alone ({outcome})"
    log.critical("%s; ended it: the restart starts a new log epoch", what)
    return f"{what}; ended it: restart to start a new log epoch"
