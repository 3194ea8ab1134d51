"""Checkpoints of the reduced state, and the log's retention horizon (DESIGN.md 3.5).

A checkpoint is ``CacheState.export()`` at an offset O: every source's tiers, fences and
incarnations, exactly what the reducer holds after the log up to O. What recovery reads besides
the log (layouts, engines, the daemon's fields, the block projection) lives in keys of its own
that are written with the records and never trimmed: it is current state, not history, so it is
not copied here (a copy as of O would only be older than the keys recovery reads).

Writing (:class:`Checkpointer`, a background task of the daemon):

1. the snapshot is the reducer's state at its offset O (records reach the reducer only once the
   log holds them, so the state at O is what the log holds up to O), exported by a forked child
   from its copy-on-write copy (offloadd.log.forked_export), so the loop does not stall;
2. it is encoded in chunks of at most ``CHUNK_EVENTS`` stored-events, each written to
   ``ckpt:{id}:{i}`` as it arrives from the child;
3. one script writes the manifest (offset, epoch, each chunk's xxh3) and swaps the pointer
   ``ckpt`` (ids of the complete checkpoints, newest first), after checking the owner lease and
   that the pointer is the one we read: a failure before this leaves the previous one in force;
4. checkpoints that left the pointer are deleted (``KEEP`` stay: the newest and the one before,
   so a torn newest falls back to its predecessor), with chunks of writes that never finished;
5. the log is trimmed to the retention horizon: each of ``retention_records``, ``retention_s``
   and ``retention_bytes`` is a floor of what is kept and the horizon is the oldest of them (the
   one keeping most), but never past the oldest kept checkpoint's offset + 1, and the last
   record always stays (readers find the log's end and epoch in it).

The format (manifest, chunks, checksums, the usability rule) is events.checkpoint, shared with
kv-bridge and kvctl, which bootstrap from the same checkpoints; this module does the daemon's
Redis I/O around it.

Loading, by recovery, is offloadd.log.checkpoint_load (re-exported here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Final

from redis.exceptions import RedisError

from events.checkpoint import (
    CHUNK_EVENTS,
    CheckpointBroken,
    Manifest,
    checkpoint_id,
    decode_manifest,
    encode_ids,
    encode_manifest,
    join,
    split,
)
from offloadd.config import OffloaddConfig
from offloadd.errors import OffloaddError
from offloadd.log.checkpoint_load import CheckpointMissing, get_key, load, pointer_ids, restore
from offloadd.log.forked_export import ExportFailed, export_chunks
from offloadd.log.metadata import LogConflict, MetadataStore, RedisUnavailable

log = logging.getLogger(__name__)

KEEP: Final[int] = 2  # complete checkpoints kept: the newest and its fallback


class CheckpointFailed(OffloaddError):
    """A checkpoint was not written (the previous one stays in force); retried later."""


@dataclass
class CheckpointStats:
    """Read by the metrics thread; written by the checkpoint task."""

    offset: int = 0
    created_ts: float = 0.0
    num_bytes: int = 0
    first_offset: int = 0
    log_length: int = 0
    num_written: int = 0
    num_failed: int = 0
    num_trimmed: int = 0


# KEYS: owner, pointer, epoch, then the keys to write. ARGV: owner value ('' = unchecked), '1'
# when the pointer must still hold ARGV[3] ('' = absent), the log's epoch ('' = unchecked), then
# per key from KEYS[4]: 'SET'/'DEL', value. The epoch check keeps a daemon that ended its log
# (offloadd.log.failover) from writing a checkpoint of the log that is gone into the keys the
# next epoch uses. Checks first, writes after: a refusal writes nothing.
_PUT = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'owner'} end
if ARGV[4] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[4] then return {'epoch'} end
if ARGV[2] == '1' then
  local t = redis.call('TYPE', KEYS[2])['ok']
  if t ~= 'none' and t ~= 'string' then return {'wrongtype', KEYS[2], t} end
  if (redis.call('GET', KEYS[2]) or '') ~= ARGV[3] then return {'moved'} end
end
for k = 4, #KEYS do
  local t = redis.call('TYPE', KEYS[k])['ok']
  if ARGV[2 * k - 3] == 'SET' and t ~= 'none' and t ~= 'string' then
    return {'wrongtype', KEYS[k], t}
  end
end
for k = 4, #KEYS do
  local a = 2 * k - 3
  if ARGV[a] == 'SET' then redis.call('SET', KEYS[k], ARGV[a + 1]) else redis.call('DEL', KEYS[k]) end
end
return {'ok'}
"""


__all__ = [
    "CHUNK_EVENTS",
    "KEEP",
    "CheckpointFailed",
    "CheckpointMissing",
    "CheckpointStats",
    "Checkpointer",
    "Manifest",
    "checkpoint_id",
    "join",
    "load",
    "restore",
    "split",
]


class Checkpointer:
    """Writes checkpoints and trims the log (module docstring); the daemon runs :meth:`run`."""

    def __init__(self, md: MetadataStore, config: OffloaddConfig, epoch: str) -> None:
        self.md = md
        self.config = config
        self.epoch = epoch
        self.stats = CheckpointStats()
        self.chunk_events = CHUNK_EVENTS
        self.fork = True  # export in a forked child (offloadd.log.forked_export); False: in the loop
        self._put = md.client.register_script(_PUT)
        self._pointer: bytes | None = None  # the pointer as last read or written
        self._is_dirty = True  # keys of unfinished or dropped checkpoints may be left

    async def run(self) -> None:
        cfg = self.config
        last = time.monotonic()
        await self._quietly(self.prime())
        while True:
            await asyncio.sleep(min(1.0, cfg.checkpoint_interval_s))
            behind = self.md.state.offset - self.stats.offset
            is_time = time.monotonic() - last >= cfg.checkpoint_interval_s
            if behind >= cfg.checkpoint_records or (behind > 0 and is_time):
                last = time.monotonic()
                await self._quietly(self.write())
            if is_time or behind >= cfg.checkpoint_records:
                last = time.monotonic()
                await self._quietly(self.trim())

    async def _quietly(self, step: Any) -> None:
        try:
            await step
        except (CheckpointFailed, RedisUnavailable, LogConflict) as exc:
            self.stats.num_failed += 1
            log.warning("checkpoint or trim failed, the previous checkpoint stays: %s", exc)
        except Exception:
            self.stats.num_failed += 1
            log.exception("checkpoint or trim failed")

    async def prime(self) -> None:
        """Stats of the newest checkpoint in Redis, and the log's bounds."""
        self._pointer = await get_key(self.md, self.md.keys.checkpoint) or b""
        for ckpt_id in pointer_ids(self._pointer)[:1]:
            raw = await get_key(self.md, self.md.keys.checkpoint_manifest(ckpt_id))
            try:
                manifest = decode_manifest(raw, ckpt_id)
            except CheckpointBroken:
                continue
            if manifest.epoch == self.epoch:
                self._note(manifest)
        await self._bounds()

    def _note(self, manifest: Manifest) -> None:
        s = self.stats
        s.offset, s.created_ts, s.num_bytes = manifest.offset, manifest.created_ts, manifest.num_bytes

    async def write(self) -> Manifest | None:
        """Write a checkpoint of the state now; None when there is nothing new.

        A forked export child that dies (status 11 was seen while gRPC's fork handlers were on,
        DECISIONS 51; anything else that kills it) costs one export in the loop, not the
        checkpoint: the stall of the pre-fork path, the guarantee kept."""
        try:
            return await self._write(self.fork)
        except CheckpointFailed as exc:
            if not (self.fork and isinstance(exc.__cause__, ExportFailed)):
                raise
            log.warning("checkpoint export child failed (%s); exporting in the loop this time", exc)
            return await self._write(False)

    async def _write(self, fork: bool) -> Manifest | None:
        if self.md.state.offset in (0, self.stats.offset):
            return None
        if self._pointer is None:
            self._pointer = await get_key(self.md, self.md.keys.checkpoint) or b""
        offset = self.md.state.offset  # no await from here to the fork in export_chunks
        keys = self.md.keys
        ckpt_id = checkpoint_id(self.epoch, offset)
        checksums: list[int] = []
        size = 0
        # The state at exactly `offset`: a forked child's copy (offloadd.log.forked_export), taken
        # before this coroutine yields again.
        chunks = export_chunks(self.md.state, self.chunk_events, fork)
        try:
            async with contextlib.aclosing(chunks):
                async for data, checksum in chunks:
                    checksums.append(checksum)
                    size += len(data)
                    self._is_dirty = True
                    await self._call([(keys.checkpoint_chunk(ckpt_id, len(checksums) - 1), data)])
        except ExportFailed as exc:
            raise CheckpointFailed(str(exc)) from exc
        manifest = Manifest(ckpt_id, offset, self.epoch, time.time(), tuple(checksums), size)
        kept = tuple(dict.fromkeys((ckpt_id, *pointer_ids(self._pointer))))[:KEEP]
        pointer = encode_ids(kept)
        try:
            await self._call([(keys.checkpoint_manifest(ckpt_id), encode_manifest(manifest)),
                              (keys.checkpoint, pointer)], expect=self._pointer)
        except CheckpointFailed:
            self._pointer = None  # in doubt or moved: read it again next time
            raise
        self._pointer = pointer
        self._note(manifest)
        self.stats.num_written += 1
        log.info("checkpoint %s written: offset %d, %d chunks, %d bytes",
                 ckpt_id, offset, len(checksums), manifest.num_bytes)
        await self._sweep(kept)
        return manifest

    async def _call(self, ops: list[tuple[str, bytes | None]], expect: bytes | None = None) -> None:
        """SET (value) or DEL (None) each key in one fenced script call."""
        md = self.md
        args: list[Any] = [md.owner, "0" if expect is None else "1", expect or b"", self.epoch]
        for _, value in ops:
            args += ("DEL", b"") if value is None else ("SET", value)
        try:
            reply = await self._put(
                keys=[md.keys.owner, md.keys.checkpoint, md.keys.epoch, *(k for k, _ in ops)], args=args)
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
        detail = [d.decode(errors="replace") for d in reply[1:]]
        raise CheckpointFailed(f"WRONGTYPE: key {detail[0]} is a {detail[1]}, expected a string; "
                               f"{md.repair_hint()}")

    async def _sweep(self, kept: tuple[str, ...]) -> None:
        """Delete every checkpoint key whose id is not in ``kept`` (dropped, or never finished)."""
        if not self._is_dirty:
            return
        prefix = self.md.keys.checkpoint_manifest("")
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + "*"
        stale: list[str] = []
        try:
            async for key in self.md.client.scan_iter(match=pattern, count=1000):
                name = key.decode(errors="replace")
                if name[len(prefix):].split(":", 1)[0] not in kept:
                    stale.append(name)
        except (RedisError, OSError) as exc:
            raise CheckpointFailed(f"Redis unreachable listing old checkpoints: {exc}") from exc
        for at in range(0, len(stale), 256):
            await self._call([(k, None) for k in stale[at : at + 256]])
        self._is_dirty = False

    async def trim(self) -> int:
        """Trim the log to the retention horizon (module docstring); how many records went."""
        md, cfg = self.md, self.config
        kept = [int(i.split("-", 1)[0]) for i in pointer_ids(self._pointer)
                if i.endswith("-" + self.epoch[:8])]
        first, length = await self._bounds()
        head = md.head
        if not kept or first == 0:
            return 0
        floors = [head + 1]
        if cfg.retention_records:
            floors.append(head - cfg.retention_records + 1)
        if cfg.retention_s:
            floors.append(await self._first_since(time.time() - cfg.retention_s, first, head))
        if cfg.retention_bytes and length:
            usage = int(await md.client.memory_usage(md.keys.log) or 0)
            floors.append(head - cfg.retention_bytes * length // max(usage, 1) + 1)
        min_offset = min(min(floors), min(kept) + 1, head)
        if min_offset <= first:
            return 0
        num = await md.trim_log(min_offset)
        self.stats.num_trimmed += num
        log.info("log trimmed: %d records before offset %d dropped", num, min_offset)
        await self._bounds()
        return num

    async def _first_since(self, cutoff: float, lo: int, hi: int) -> int:
        """The first offset in [lo, hi] whose record is stamped at or after ``cutoff``."""
        end = hi + 1
        while lo < end:
            mid = (lo + end) // 2
            records = await self.md.read_range(mid, 1, validate=False)
            if records and records[0].ts >= cutoff:
                end = mid
            else:
                lo = mid + 1
        return lo

    async def _bounds(self) -> tuple[int, int]:
        first, length = await self.md.log_bounds()
        self.stats.first_offset, self.stats.log_length = first, length
        return first, length
