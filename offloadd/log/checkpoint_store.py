"""The daemon's checkpoint keys in Redis (offloadd.log.checkpoint writes checkpoints with it):
one fenced script for every write, and the bookkeeping of the content-addressed chunks (format
2 of events.checkpoint, DECISIONS 60): which chunks the kept checkpoints list, which of those
Redis holds, and the sweep that deletes the rest, never a chunk a kept checkpoint lists.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from redis.exceptions import RedisError

from events.checkpoint import CheckpointBroken, decode_manifest
from offloadd.errors import OffloaddError
from offloadd.log.checkpoint_load import get_key
from offloadd.log.metadata import MetadataStore, RedisUnavailable

log = logging.getLogger("offloadd.log.checkpoint")

# KEYS: owner, pointer, epoch, then ARGV[5] keys that must exist, then the keys to write. ARGV:
# owner value ('' = unchecked), '1' when the pointer must still hold ARGV[3] ('' = absent), the
# log's epoch ('' = unchecked), the number of must-exist keys, then per key to write: 'SET'/'DEL',
# value. The epoch check keeps a daemon that ended its log (offloadd.log.failover) from writing a
# checkpoint of the log that is gone into the keys the next epoch uses; the must-exist check
# keeps a manifest from being pointed to while a chunk it lists is gone. Checks first, writes
# after: a refusal writes nothing.
_PUT = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'owner'} end
if ARGV[4] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[4] then return {'epoch'} end
if ARGV[2] == '1' then
  local t = redis.call('TYPE', KEYS[2])['ok']
  if t ~= 'none' and t ~= 'string' then return {'wrongtype', KEYS[2], t} end
  if (redis.call('GET', KEYS[2]) or '') ~= ARGV[3] then return {'moved'} end
end
local m = tonumber(ARGV[5])
for k = 4, 3 + m do
  if redis.call('EXISTS', KEYS[k]) == 0 then return {'missing', KEYS[k]} end
end
for k = 4 + m, #KEYS do
  local t = redis.call('TYPE', KEYS[k])['ok']
  if ARGV[2 * (k - m) - 2] == 'SET' and t ~= 'none' and t ~= 'string' then
    return {'wrongtype', KEYS[k], t}
  end
end
for k = 4 + m, #KEYS do
  local a = 2 * (k - m) - 2
  if ARGV[a] == 'SET' then redis.call('SET', KEYS[k], ARGV[a + 1]) else redis.call('DEL', KEYS[k]) end
end
return {'ok'}
"""


class CheckpointFailed(OffloaddError):
    """A checkpoint was not written (the previous one stays in force); retried later."""


class CheckpointStore:
    """Fenced writes of checkpoint keys, and which chunks are listed, held and stale."""

    def __init__(self, md: MetadataStore, epoch: str) -> None:
        self.md = md
        self.epoch = epoch
        self._script = md.client.register_script(_PUT)
        self.listed: dict[str, frozenset[str]] = {}  # checkpoint id -> its chunks' addresses
        self.is_dirty = True  # keys of unfinished or dropped checkpoints may be left
        self.is_unsure = True  # whether chunks the kept checkpoints list may be gone

    def forget(self) -> None:
        """After a failed swap: what the kept checkpoints list, and what Redis holds, are read
        again."""
        self.listed.clear()
        self.is_unsure = True

    async def present(self, ids: tuple[str, ...]) -> set[str]:
        """The chunks of the checkpoints ``ids`` that Redis holds: each checked once after a
        start or a failed checkpoint (a chunk a kept checkpoint lists may have been lost, and
        would fail every checkpoint that reused it), else taken from what was written."""
        listed = await self.referenced(ids)
        if not self.is_unsure or not listed:
            self.is_unsure = False
            return listed
        names = sorted(listed)
        try:
            async with self.md.client.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.exists(self.md.keys.checkpoint_content(name))
                found = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(f"Redis unreachable checking checkpoint chunks: {exc}") from exc
        missing = {n for n, hit in zip(names, found, strict=True) if not hit}
        if missing:
            log.warning("%d chunks the kept checkpoints list are gone: written again", len(missing))
        self.is_unsure = False
        return listed - missing

    async def referenced(self, ids: tuple[str, ...]) -> set[str]:
        """The addresses of every chunk the checkpoints ``ids`` list (manifests read when not
        known; a broken one, unusable anyway, lists none)."""
        out: set[str] = set()
        for ckpt_id in ids:
            if ckpt_id not in self.listed:
                raw = await get_key(self.md, self.md.keys.checkpoint_manifest(ckpt_id))
                try:
                    self.listed[ckpt_id] = frozenset(decode_manifest(raw, ckpt_id).chunks)
                except CheckpointBroken as exc:
                    log.warning("checkpoint %s: %s; it keeps no chunks", ckpt_id, exc)
                    continue
            out |= self.listed[ckpt_id]
        return out

    async def write(self, batch: dict[str, bytes]) -> None:
        """Write the chunks of ``batch`` (address -> bytes) in one fenced call, and empty it."""
        if batch:
            self.is_dirty = True
            await self.put([(self.md.keys.checkpoint_content(a), d) for a, d in batch.items()])
            batch.clear()

    async def put(self, ops: list[tuple[str, bytes | None]], expect: bytes | None = None,
                    must_exist: list[str] | None = None) -> None:
        """SET (value) or DEL (None) each key in one fenced script call, once each key of
        ``must_exist`` is found."""
        md = self.md
        need = must_exist or []
        args: list[Any] = [md.owner, "0" if expect is None else "1", expect or b"", self.epoch, len(need)]
        for _, value in ops:
            args += ("DEL", b"") if value is None else ("SET", value)
        try:
            reply = await self._script(
                keys=[md.keys.owner, md.keys.checkpoint, md.keys.epoch, *need, *(k for k, _ in ops)],
                args=args)
        except (RedisError, OSError) as exc:
            raise CheckpointFailed(f"Redis unreachable or refused the write: {exc}") from exc
        code = reply[0].decode()
        if code == "ok":
            return
        if code == "owner":
            raise CheckpointFailed("the namespace's owner lease is not ours: write refused")
        if code == "epoch":
            raise CheckpointFailed(f"{md.keys.epoch} is no longer {self.epoch}: the log this "
                                   "checkpoint is of was ended; not written")
        if code == "moved":
            raise CheckpointFailed(f"{md.keys.checkpoint} changed under the daemon: not swapped")
        if code == "missing":
            raise CheckpointFailed(f"chunk {reply[1].decode(errors='replace')} is gone: not swapped")
        detail = [d.decode(errors="replace") for d in reply[1:]]
        raise CheckpointFailed(f"WRONGTYPE: key {detail[0]} is a {detail[1]}, expected a string; "
                               f"{md.repair_hint()}")

    async def sweep(self, kept: tuple[str, ...]) -> None:
        """Delete every checkpoint key whose id is not in ``kept`` (dropped, or never finished),
        and every chunk no checkpoint of ``kept`` lists."""
        if not self.is_dirty:
            return
        for ckpt_id in [i for i in self.listed if i not in kept]:
            del self.listed[ckpt_id]
        try:
            referenced = await self.referenced(kept)
        except RedisUnavailable as exc:
            raise CheckpointFailed(str(exc)) from exc
        prefix, shared = self.md.keys.checkpoint_manifest(""), self.md.keys.checkpoint_content_prefix
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + "*"
        stale: list[str] = []
        try:
            async for key in self.md.client.scan_iter(match=pattern, count=1000):
                name = key.decode(errors="replace")
                if name.startswith(shared):
                    if name[len(shared):] not in referenced:
                        stale.append(name)
                elif name[len(prefix):].split(":", 1)[0] not in kept:
                    stale.append(name)
        except (RedisError, OSError) as exc:
            raise CheckpointFailed(f"Redis unreachable listing old checkpoints: {exc}") from exc
        for at in range(0, len(stale), 256):
            await self.put([(k, None) for k in stale[at : at + 256]])
        self.is_dirty = False

