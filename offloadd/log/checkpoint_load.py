"""Recovery's side of checkpoints (offloadd.log.checkpoint writes them): the newest usable one
loaded into the reducer.

:func:`restore` walks the pointer's checkpoints newest first; the first whose manifest and chunks
verify, of the log's epoch, and whose tail the log still holds (its oldest record is at most
O + 1) is loaded into the reducer (``CacheState.restore``, in place); recovery replays the log
from O + 1. With none usable the whole log is replayed when it still starts at offset 1;
otherwise :class:`CheckpointMissing` stops startup, never a wrong state.
"""

from __future__ import annotations

import logging

from redis.exceptions import RedisError

from events.checkpoint import (
    CheckpointBroken,
    Manifest,
    chunk_keys,
    decode_ids,
    decode_manifest,
    decode_snapshot,
    unusable,
)
from events.schema import SchemaError
from events.state import Snapshot
from offloadd.errors import ForeignData
from offloadd.log.metadata import MetadataStore, RedisUnavailable

log = logging.getLogger("offloadd.log.checkpoint")


class CheckpointMissing(ForeignData):
    """The log was trimmed and no complete checkpoint covers what it no longer holds."""


def pointer_ids(raw: bytes | None) -> tuple[str, ...]:
    """The pointer's ids, newest first; none (logged) when it is garbled."""
    try:
        return decode_ids(raw)
    except CheckpointBroken as exc:
        log.error("checkpoint %s: ignored", exc)
        return ()


async def get_key(md: MetadataStore, key: str) -> bytes | None:
    """One key's value; RedisUnavailable when Redis cannot be reached."""
    try:
        raw = await md.client.get(key)
    except (RedisError, OSError) as exc:
        raise RedisUnavailable(f"Redis unreachable reading {key}: {exc}") from exc
    return None if raw is None else bytes(raw)


async def load(md: MetadataStore, ckpt_id: str) -> tuple[Manifest, Snapshot]:
    """A checkpoint, verified (events.checkpoint); CheckpointBroken names what is missing or bad."""
    keys = md.keys
    try:
        manifest = decode_manifest(await md.client.get(keys.checkpoint_manifest(ckpt_id)), ckpt_id)
        async with md.client.pipeline(transaction=False) as pipe:
            for name in chunk_keys(keys, manifest):
                pipe.get(name)
            datas = await pipe.execute(raise_on_error=False)
    except (RedisError, OSError) as exc:
        if isinstance(exc, OSError) or "WRONGTYPE" not in str(exc):
            raise RedisUnavailable(f"Redis unreachable reading checkpoint {ckpt_id}: {exc}") from exc
        raise CheckpointBroken(str(exc)) from exc
    return manifest, decode_snapshot(manifest, datas)


async def restore(md: MetadataStore) -> Manifest | None:
    """Load the newest usable checkpoint into ``md.state`` (module docstring); None when the
    whole log is to be replayed. CheckpointMissing when neither is possible."""
    first, _ = await md.log_bounds()
    raw_epoch = await get_key(md, md.keys.epoch)
    epoch = raw_epoch.decode(errors="replace") if raw_epoch is not None else None
    for ckpt_id in pointer_ids(await get_key(md, md.keys.checkpoint)):
        try:
            manifest, snap = await load(md, ckpt_id)
        except CheckpointBroken as exc:
            log.error("checkpoint %s is unusable (%s); trying an older one", ckpt_id, exc)
            continue
        problem = unusable(manifest, epoch, first)
        if problem is not None:
            log.error("checkpoint %s is %s; not used", ckpt_id, problem)
            continue
        try:
            md.state.restore(snap)  # in place: the store, ingest and metrics hold this one state
        except SchemaError as exc:
            log.error("checkpoint %s holds an invalid event (%s); trying an older one", ckpt_id, exc)
            continue
        log.info("loaded checkpoint %s at offset %d", ckpt_id, manifest.offset)
        return manifest
    if first > 1:
        raise CheckpointMissing(
            f"the log {md.keys.log} starts at offset {first} and no complete checkpoint covers "
            f"the records before it: refusing to start with a wrong state; restore the "
            f"checkpoint keys {md.keys.checkpoint}* or start the namespace afresh")
    return None
