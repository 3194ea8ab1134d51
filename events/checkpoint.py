"""The checkpoint format (DESIGN.md 3.5): one implementation for the daemon that writes it and
every reader (the daemon's recovery, kv-bridge, kvctl). Pure: the callers do the Redis I/O.

A checkpoint is ``CacheState.export()`` at a log offset O, stored under the keys of
events.logkeys: the pointer ``ckpt`` (msgpack list of complete checkpoints' ids, newest first),
per checkpoint a :class:`Manifest` and its chunks (msgpack tuples of SourceSnapshot slices, at
most ``CHUNK_EVENTS`` events each; a source may span chunks). The manifest holds each chunk's
xxh3_64, so a reader verifies before it trusts.

A checkpoint is usable by a reader when it verifies, is of the log's epoch and the log still
holds its tail (the log's oldest record is at most O + 1): :func:`unusable` is that rule, and
:func:`candidates` walks the pointer newest first with it for synchronous readers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import xxhash

from events.errors import EventsError
from events.logkeys import LogKeys
from events.state import Snapshot, SourceSnapshot

CHUNK_EVENTS: Final[int] = 4096  # stored-events per chunk (a few hundred KiB)


class Manifest(msgspec.Struct, frozen=True):
    ckpt_id: str
    offset: int
    epoch: str
    created_ts: float
    checksums: tuple[int, ...]  # xxh3_64 of each chunk, in order
    num_bytes: int


class CheckpointBroken(EventsError):
    """A checkpoint's pointer, manifest or one of its chunks is missing or does not verify."""


_encoder = msgspec.msgpack.Encoder()
_ids = msgspec.msgpack.Decoder(tuple[str, ...])
_manifest = msgspec.msgpack.Decoder(Manifest)
_chunk = msgspec.msgpack.Decoder(tuple[SourceSnapshot, ...])


def checkpoint_id(epoch: str, offset: int) -> str:
    return f"{offset}-{epoch[:8]}"


def encode_ids(ids: Sequence[str]) -> bytes:
    return _encoder.encode(tuple(ids))


def decode_ids(raw: bytes | None) -> tuple[str, ...]:
    """The pointer's ids, newest first (none when absent); CheckpointBroken when garbled."""
    if not raw:
        return ()
    try:
        return _ids.decode(raw)
    except msgspec.DecodeError as exc:
        raise CheckpointBroken(f"the pointer holds {raw[:40]!r}, not a list of ids") from exc


def encode_manifest(manifest: Manifest) -> bytes:
    return _encoder.encode(manifest)


def decode_manifest(raw: object, ckpt_id: str | None = None) -> Manifest:
    """The manifest stored as ``raw``; CheckpointBroken when missing, garbled or of another id."""
    if raw is None:
        raise CheckpointBroken("manifest missing")
    if not isinstance(raw, bytes):
        raise CheckpointBroken(f"manifest unreadable: {raw}")
    try:
        manifest = _manifest.decode(raw)
    except msgspec.DecodeError as exc:
        raise CheckpointBroken(f"manifest does not decode: {exc}") from exc
    if ckpt_id is not None and manifest.ckpt_id != ckpt_id:
        raise CheckpointBroken(f"manifest names {manifest.ckpt_id}")
    return manifest


def encode_chunk(part: tuple[SourceSnapshot, ...]) -> tuple[bytes, int]:
    """A chunk's stored bytes and the checksum its manifest records."""
    data = _encoder.encode(part)
    return data, xxhash.xxh3_64_intdigest(data)


def decode_snapshot(manifest: Manifest, datas: Sequence[object]) -> Snapshot:
    """The snapshot from the chunks stored for ``manifest`` (in order, None when missing),
    each verified against its checksum; CheckpointBroken names the first bad one."""
    if len(datas) != len(manifest.checksums):
        raise CheckpointBroken(f"{len(datas)} chunks read, the manifest lists {len(manifest.checksums)}")
    chunks = []
    for i, (data, want) in enumerate(zip(datas, manifest.checksums, strict=True)):
        if not isinstance(data, bytes):
            raise CheckpointBroken(f"chunk {i} {'missing' if data is None else data}")
        if xxhash.xxh3_64_intdigest(data) != want:
            raise CheckpointBroken(f"chunk {i} checksum mismatch")
        try:
            chunks.append(_chunk.decode(data))
        except msgspec.DecodeError as exc:
            raise CheckpointBroken(f"chunk {i} does not decode: {exc}") from exc
    return join(manifest.offset, chunks)


def unusable(manifest: Manifest, epoch: str | None, first_offset: int) -> str | None:
    """Why a verified checkpoint cannot rebuild the log's state (None: it can): another epoch's,
    or the log (oldest record ``first_offset``, 0 when empty) no longer holds its tail."""
    if manifest.epoch != epoch:
        return f"of log epoch {manifest.epoch}, the log is {epoch}"
    if first_offset == 0 or first_offset > manifest.offset + 1:
        return f"at offset {manifest.offset}: the log (oldest record {first_offset}) no longer holds its tail"
    return None


@dataclass(frozen=True)
class Candidate:
    """One checkpoint of the pointer: its manifest and snapshot, or why it cannot be used."""

    ckpt_id: str
    manifest: Manifest | None = None
    snapshot: Snapshot | None = None
    problem: str | None = None


def candidates(
    keys: LogKeys, fetch: Callable[[list[str]], Sequence[Any]], epoch: str | None, first_offset: int,
) -> Iterator[Candidate]:
    """The pointer's checkpoints newest first, for synchronous readers; ``fetch`` reads keys
    (``redis.Redis.mget``: None for a missing one). A garbled pointer is one broken candidate."""
    try:
        ids = decode_ids(fetch([keys.checkpoint])[0])
    except CheckpointBroken as exc:
        yield Candidate("?", problem=str(exc))
        return
    for ckpt_id in ids:
        try:
            manifest = decode_manifest(fetch([keys.checkpoint_manifest(ckpt_id)])[0], ckpt_id)
            problem = unusable(manifest, epoch, first_offset)
            if problem is not None:
                yield Candidate(ckpt_id, manifest, problem=problem)
                continue
            chunk_keys = [keys.checkpoint_chunk(ckpt_id, i) for i in range(len(manifest.checksums))]
            datas = fetch(chunk_keys) if chunk_keys else []
            yield Candidate(ckpt_id, manifest, decode_snapshot(manifest, datas))
        except CheckpointBroken as exc:
            yield Candidate(ckpt_id, problem=str(exc))


def split(snap: Snapshot, per_chunk: int = CHUNK_EVENTS) -> Iterator[tuple[SourceSnapshot, ...]]:
    """The snapshot's sources in slices of at most ``per_chunk`` events, in order; a source
    may span chunks (:func:`join` puts it back together)."""
    part: list[SourceSnapshot] = []
    size = 0
    for src in snap.sources:
        at = 0
        while True:
            take = src.events[at : at + per_chunk - size]
            part.append(SourceSnapshot(src.source, src.incarnation, src.last_seq, take))
            size += len(take)
            at += len(take)
            if size >= per_chunk:
                yield tuple(part)
                part, size = [], 0
            if at >= len(src.events):
                break
    if part:
        yield tuple(part)


def join(offset: int, chunks: Sequence[tuple[SourceSnapshot, ...]]) -> Snapshot:
    merged: dict[str, tuple[int, int, list[Any]]] = {}
    for chunk in chunks:
        for piece in chunk:
            merged.setdefault(piece.source, (piece.incarnation, piece.last_seq, []))[2].extend(piece.events)
    return Snapshot(offset, tuple(
        SourceSnapshot(source, inc, seq, tuple(events)) for source, (inc, seq, events) in merged.items()
    ))
