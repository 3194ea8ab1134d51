"""Keys of daemons before hash tags (``kvd:<ns>:*``) renamed to ``kvd:{<ns>}:*`` (DECISIONS 40).

Run at start, before the owner lease is taken. Only a standalone or Sentinel-managed Redis can
hold them: an older daemon's write script spans several slots, so it never ran on a Cluster.
One script renames every key of the namespace at once (RENAMENX: a key of the new form is never
overwritten; TTLs, the owner lease's included, move with the key), so a crash leaves either
form whole. The owner lease moving with the rest means an older daemon still running is refused
by the next write of its own (its head key is gone) and a new daemon waits for its lease as
for any owner. Keys of both forms side by side are left alone and reported.
"""

from __future__ import annotations

import logging
from typing import Any

from redis.exceptions import RedisError

from events.logkeys import LogKeys
from offloadd.log.metadata import RedisUnavailable
from rpc.redis_connect import is_cluster

log = logging.getLogger(__name__)

# KEYS: old names, then the new names in the same order. Returns how many were renamed, or -1
# (nothing renamed) when a new name exists already.
_RENAME = """
local n = #KEYS / 2
for i = 1, n do
  if redis.call('EXISTS', KEYS[n + i]) == 1 then return -1 end
end
for i = 1, n do redis.call('RENAMENX', KEYS[i], KEYS[n + i]) end
return n
"""


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


async def migrate_legacy_keys(client: Any, keys: LogKeys) -> int:
    """Rename the namespace's keys of the old form; returns how many were renamed."""
    if is_cluster(client):
        return 0
    old = keys.legacy_prefix
    try:
        names = sorted({bytes(k).decode() async for k in
                        client.scan_iter(match=_glob_escape(old) + "*", count=1000)})
        if not names:
            return 0
        new = [keys.prefix + name[len(old):] for name in names]
        renamed = int(await client.eval(_RENAME, 2 * len(names), *names, *new))
    except RedisError as exc:
        raise RedisUnavailable(f"Redis unreachable while looking for keys of the old form: {exc}") from exc
    if renamed < 0:
        log.error("namespace %s has keys of both forms (%s* and %s*): the old ones are left "
                  "alone; delete them once nothing needs them", keys.namespace, old, keys.prefix)
        return 0
    log.warning("renamed %d keys of namespace %s from %s* to %s* (DECISIONS 40)",
                renamed, keys.namespace, old, keys.prefix)
    return renamed
