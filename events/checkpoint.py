"""The checkpoint format (DESIGN.md 3.5): one implementation for the daemon that writes it and
every reader (the daemon's recovery, kv-bridge, kvctl). Pure: the callers do the Redis I/O.

A checkpoint is the reducer's state at a log offset O, stored under the keys of
events.logkeys: the pointer ``ckpt`` (msgpack list of complete checkpoints' ids, newest first),
per checkpoint a :class:`Manifest` and its chunks (msgpack tuples of SourceSnapshot slices; a
source may span chunks, :func:`join` puts it back together). Two formats:

- format 2 (written now): chunks (zlib-compressed msgpack) are content-addressed, ``ckpt:chunk:{address}`` with the
  address the hex blake2b-128 of the bytes, and shared by every checkpoint that lists them; the
  manifest lists the addresses in order and every source's fence (the chunks hold none, so an
  unchanged tier's chunks stay the same bytes). How a state is cut into such chunks is
  events.checkpoint_cut. The manifest's ``checksums`` is ``(0,)``, so a reader of format 1 finds
  its "chunk 0" missing and leaves the checkpoint out, never reads an empty state;
- format 1 (before DECISIONS 60): chunks ``ckpt:{id}:{i}`` of at most ``CHUNK_EVENTS``
  events, verified by the xxh3_64 the manifest lists; still read, and written by :func:`split`
  for tests and benchmarks that build old checkpoints.

A reader verifies every chunk before it trusts it.

A checkpoint is usable by a reader when it verifies, is of the log's epoch and the log still
holds its tail (the log's oldest record is at most O + 1): :func:`unusable` is that rule, and
:func:`candidates` walks the pointer newest first with it for synchronous readers.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import xxhash

from events.errors import EventsError
from events.logkeys import LogKeys
from events.state import Snapshot, SourceSnapshot

CHUNK_EVENTS: Final[int] = 4096  # format 1: stored-events per chunk (a few hundred KiB)
FORMAT: Final[int] = 2  # the newest format this module reads and the daemon writes


class Manifest(msgspec.Struct, frozen=True):
    ckpt_id: str
    offset: int
    epoch: str
    created_ts: float
    checksums: tuple[int, ...]  # format 1: xxh3_64 of each chunk, in order; format 2: (0,)
    num_bytes: int  # the chunks' bytes, shared ones included
    format: int = 1
    chunks: tuple[str, ...] = ()  # format 2: each chunk's content address, in order
    fences: tuple[tuple[str, int, int], ...] = ()  # format 2: (source, incarnation, last_seq) each


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
    """Format 1: a chunk's stored bytes and the checksum its manifest records."""
    data = _encoder.encode(part)
    return data, xxhash.xxh3_64_intdigest(data)


def chunk_address(data: bytes) -> str:
    """Format 2: the content address of a chunk's bytes. A digest made for collisions to be out
    of reach (DECISIONS 60): chunks hold token ids that clients choose, and two chunks with one
    address would be one chunk."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def chunk_keys(keys: LogKeys, manifest: Manifest) -> list[str]:
    """The keys of the manifest's chunks, in order; CheckpointBroken for a format this reader
    does not know (a newer daemon's: left out, never misread)."""
    if manifest.format == 1:
        return [keys.checkpoint_chunk(manifest.ckpt_id, i) for i in range(len(manifest.checksums))]
    if manifest.format == 2:
        return [keys.checkpoint_content(a) for a in manifest.chunks]
    raise CheckpointBroken(f"format {manifest.format} is newer than this reader's ({FORMAT})")


def decode_snapshot(manifest: Manifest, datas: Sequence[object]) -> Snapshot:
    """The snapshot from the chunks stored for ``manifest`` (in order, None when missing, as
    :func:`chunk_keys` lists them), each verified first; CheckpointBroken names the first bad one."""
    v2 = manifest.format == 2
    wants: Sequence[object] = manifest.chunks if v2 else manifest.checksums
    if manifest.format not in (1, 2):
        raise CheckpointBroken(f"format {manifest.format} is newer than this reader's ({FORMAT})")
    if len(datas) != len(wants):
        raise CheckpointBroken(f"{len(datas)} chunks read, the manifest lists {len(wants)}")
    chunks = []
    for i, (data, want) in enumerate(zip(datas, wants, strict=True)):
        if not isinstance(data, bytes):
            raise CheckpointBroken(f"chunk {i} {'missing' if data is None else data}")
        if (chunk_address(data) if v2 else xxhash.xxh3_64_intdigest(data)) != want:
            raise CheckpointBroken(f"chunk {i} checksum mismatch")
        try:
            chunks.append(_chunk.decode(zlib.decompress(data) if v2 else data))
        except (msgspec.DecodeError, zlib.error) as exc:
            raise CheckpointBroken(f"chunk {i} does not decode: {exc}") from exc
    return join(manifest.offset, chunks, manifest.fences)


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
            names = chunk_keys(keys, manifest)
            datas = fetch(names) if names else []
            yield Candidate(ckpt_id, manifest, decode_snapshot(manifest, datas))
        except CheckpointBroken as exc:
            yield Candidate(ckpt_id, problem=str(exc))


def split(snap: Snapshot, per_chunk: int = CHUNK_EVENTS) -> Iterator[tuple[SourceSnapshot, ...]]:
    """Format 1: the snapshot's sources in slices of at most ``per_chunk`` events, in order; a source
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


def join(offset: int, chunks: Sequence[tuple[SourceSnapshot, ...]],
         fences: Sequence[tuple[str, int, int]] = ()) -> Snapshot:
    """The snapshot of the chunks' pieces, each source's put together; ``fences`` (format 2)
    lists every source first, with its fence (the pieces then carry none)."""
    merged: dict[str, tuple[int, int, list[Any]]] = {s: (inc, seq, []) for s, inc, seq in fences}
    for chunk in chunks:
        for piece in chunk:
            merged.setdefault(piece.source, (piece.incarnation, piece.last_seq, []))[2].extend(piece.events)
    return Snapshot(offset, tuple(
        SourceSnapshot(source, inc, seq, tuple(events)) for source, (inc, seq, events) in merged.items()
    ))
