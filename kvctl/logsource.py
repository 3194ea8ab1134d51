"""Where kvctl reads log records from: a JSON-lines file (``kvctl record``, exports) or the live
log in Redis (``redis://...`` with ``--namespace``). kvctl is an entry point, so it may create
the Redis client (DESIGN.md 5); the import is lazy so file-only use needs no Redis.

The daemon trims the Redis log behind its checkpoints (DESIGN.md 3.5): :func:`open_log` reads a
trimmed log as its newest usable checkpoint (events.checkpoint) plus the records after it, and
:func:`iter_records` only the retained records.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from events.checkpoint import Manifest, candidates
from events.codec_jsonl import load_records
from events.logkeys import LogKeys
from events.logreader import LogReader, LogUnavailable
from events.schema import LogRecord
from events.state import CacheState, Snapshot
from kvctl.errors import KvctlError
from kvctl.progress import Progress


def add_source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", metavar="FILE|redis://HOST:PORT/DB", help="a recorded file or a Redis URL")
    p.add_argument("--namespace", default="default", help="deployment namespace in Redis")
    p.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None,
        help="progress line on stderr (default: when stderr is a terminal)",
    )


def is_redis(spec: str) -> bool:
    return spec.startswith(("redis://", "rediss://", "unix://"))


@dataclass
class LogView:
    """A log as a starting state and the records after it."""

    records: Iterator[LogRecord]
    base: Snapshot | None = None  # the checkpoint the records follow (None: offset 0)
    manifest: Manifest | None = None

    def state(self) -> CacheState:
        """The state the records apply to (SchemaError on a checkpoint's invalid event)."""
        return CacheState() if self.base is None else CacheState.from_snapshot(self.base)

    @property
    def note(self) -> str:
        """What the output says about where the state started ('' from offset 1)."""
        return "" if self.base is None else f"from checkpoint at offset {self.base.offset}"


def iter_records(
    args: argparse.Namespace, until_offset: int | None = None, label: str = "reading"
) -> Iterator[LogRecord]:
    """Records of ``args.log`` in offset order, up to ``until_offset`` when given (on a trimmed
    Redis log, the retained ones: :func:`open_log` for the state before them)."""
    progress_flag: bool | None = getattr(args, "progress", None)
    if is_redis(args.log):
        yield from _from_redis(args.log, args.namespace, until_offset, label, progress_flag)
    else:
        yield from _from_file(args.log, until_offset, label, progress_flag)


def open_log(args: argparse.Namespace, until_offset: int | None = None, label: str = "reading") -> LogView:
    """:func:`iter_records`, but a trimmed Redis log starts from its newest usable checkpoint
    at or before ``until_offset``; KvctlError when none is (naming the oldest offset that can
    be rebuilt)."""
    if not is_redis(args.log):
        return LogView(iter_records(args, until_offset, label))
    with _client(args.log) as client:
        manifest, base = redis_base(client, _keys(args.namespace), args.log, until_offset)
    progress_flag: bool | None = getattr(args, "progress", None)
    after = 0 if manifest is None else manifest.offset
    records = _from_redis(args.log, args.namespace, until_offset, label, progress_flag, after)
    return LogView(records, base, manifest)


def redis_base(
    client: Any, keys: LogKeys, url: str, until: int | None = None,
) -> tuple[Manifest | None, Snapshot | None]:
    """The newest usable checkpoint (at or before ``until``) of a trimmed log; (None, None)
    when the log starts at offset 1, or when it is trimmed, no checkpoint is usable and no
    offset is asked for (the retained records are all there is)."""
    import redis  # lazy, as in _from_redis

    transient = (redis.ConnectionError, redis.TimeoutError, OSError)
    try:
        first = LogReader(client, keys, transient).first_offset()
        if first <= 1:
            return None, None
        epoch = log_epoch(client, keys)
        usable = []
        for c in candidates(keys, lambda names: client.mget(names), epoch, first):
            if c.manifest is None or c.snapshot is None:
                print(f"kvctl: checkpoint {c.ckpt_id} is unusable ({c.problem})", file=sys.stderr)
            else:
                usable.append((c.manifest, c.snapshot))
    except (*transient, LogUnavailable, redis.ResponseError) as exc:
        raise KvctlError(f"cannot read the log at {url}: {exc}") from None
    fitting = [c for c in usable if until is None or c[0].offset <= until]
    if fitting:
        return fitting[0]
    if until is None and not usable:
        return None, None
    archive = "; to rebuild older states, replay an archive written by 'kvctl record --follow'"
    if not usable:
        raise KvctlError(f"offset {until} cannot be rebuilt from {url}: the log starts at offset "
                         f"{first} and no usable checkpoint covers the records before it{archive}")
    oldest = min(m.offset for m, _ in usable)
    raise KvctlError(f"offset {until} cannot be rebuilt from {url}: the log starts at offset {first} "
                     f"and the oldest checkpoint is at offset {oldest}, the oldest offset it can "
                     f"rebuild{archive}")


def _keys(namespace: str) -> LogKeys:
    try:
        return LogKeys(namespace)
    except ValueError as exc:
        raise KvctlError(str(exc)) from None


def _client(url: str) -> Any:
    import redis  # lazy: only the Redis source needs it

    return redis.Redis.from_url(url, socket_connect_timeout=3.0, socket_timeout=30.0)


def _from_file(
    path: str, until: int | None, label: str, progress_flag: bool | None
) -> Iterator[LogRecord]:
    if not os.path.exists(path):
        raise KvctlError(f"no such file: {path} (give a file from 'kvctl record' or a redis:// URL)")
    progress = Progress(label, os.path.getsize(path), "bytes", progress_flag)
    try:
        with open(path, "rb") as fp:
            for record in load_records(_counting(fp, progress)):
                if until is not None and record.offset > until:
                    return
                yield record
    finally:
        progress.close()


def _counting(fp: Any, progress: Progress) -> Iterator[bytes]:
    for line in fp:
        progress.advance(len(line))
        yield line


def log_epoch(client: Any, keys: LogKeys) -> str | None:
    """The log's epoch (DESIGN 3.5); None for a log without one."""
    import redis  # lazy, as in _from_redis

    try:
        raw = client.get(keys.epoch)
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        raise LogUnavailable(f"redis unavailable: {exc}") from exc
    return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)


def check_epoch(client: Any, keys: LogKeys, epoch: str | None) -> None:
    """Raise KvctlError when the log is no longer the one of ``epoch`` (Redis lost it and the
    daemon started a new one): records read before and after would mix two logs."""
    now = log_epoch(client, keys)
    if now != epoch:
        raise KvctlError(
            f"the log's epoch changed from {epoch} to {now} while reading: the log was lost and "
            "a new one started (offsets restart at 1); run the command again"
        )


def _from_redis(
    url: str, namespace: str, until: int | None, label: str, progress_flag: bool | None,
    after: int = 0,
) -> Iterator[LogRecord]:
    import redis  # lazy: only the Redis source needs it

    keys = _keys(namespace)
    client = _client(url)
    reader = LogReader(client, keys, (redis.ConnectionError, redis.TimeoutError, OSError))
    progress: Progress | None = None
    try:
        epoch = log_epoch(client, keys)
        head = reader.head()
        total = head if until is None else min(head, until)
        progress = Progress(label, max(0, total - after), "records", progress_flag)
        for n, record in enumerate(reader.iter_range(after + 1, total), start=1):
            if n % 10_000 == 0:
                check_epoch(client, keys, epoch)
            progress.advance()
            yield record
        check_epoch(client, keys, epoch)  # what was read is one log, not two halves
    except LogUnavailable as exc:
        raise KvctlError(f"cannot read the log at {url}: {exc}") from None
    finally:
        if progress is not None:
            progress.close()
        client.close()
