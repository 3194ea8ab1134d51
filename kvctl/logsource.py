"""Where kvctl reads log records from: a JSON-lines file (``kvctl record``, exports), an
archive directory (``kvctl record --follow``) or the live log in Redis (``redis://...`` with
``--namespace``), an archive and the live log together with ``--archive``. kvctl is an entry
point, so it may create the Redis client (DESIGN.md 5); the import is lazy so file-only use
needs no Redis.

The daemon trims the Redis log behind its checkpoints (DESIGN.md 3.5): :func:`open_log` reads
archive and log as one timeline (kvctl.history) that starts at offset 0 or a checkpoint, and
:func:`iter_records` only the records a file or the Redis log holds.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from typing import Any

from events.checkpoint import candidates
from events.codec_jsonl import load_records
from events.logkeys import LogKeys
from events.logreader import LogReader, LogUnavailable
from events.schema import LogRecord
from kvctl.archive import Archive
from kvctl.errors import KvctlError
from kvctl.history import Base, LogView, Piece, RedisRecords, archive_part, plan
from kvctl.progress import Progress


def add_source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", metavar="FILE|redis://HOST:PORT/DB", help="a recorded file, an archive directory or a Redis URL")
    p.add_argument("--namespace", default="default", help="deployment namespace in Redis")
    p.add_argument("--archive", metavar="DIR", help="an archive from 'kvctl record --follow', read "
                   "first: the archive up to its last record, then the live log (one timeline)")
    p.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None,
        help="progress line on stderr (default: when stderr is a terminal)",
    )


def is_redis(spec: str) -> bool:
    return spec.startswith(("redis://", "rediss://", "unix://", "redis+", "rediss+"))


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


def archive_dir(args: argparse.Namespace) -> str | None:
    """The archive to read: ``--archive``, or the log argument when it is a directory."""
    given: str | None = getattr(args, "archive", None)
    if given is not None:
        return given
    return args.log if os.path.isdir(args.log) else None


def open_log(
    args: argparse.Namespace, until_offset: int | None = None, label: str = "reading",
    earliest: bool = False, live: RedisRecords | None = None, lenient: bool = False,
) -> LogView:
    """The log of ``args`` as one timeline (kvctl.history): an archive (``--archive`` or a
    directory) and/or the live Redis log, or a file. The state starts from the newest start
    (offset 0 or a checkpoint) at or before ``until_offset``, or with ``earliest`` the oldest one
    from which the end can be reached; KvctlError when none can (naming the oldest offset that
    can be rebuilt). ``live`` replaces the reader of the Redis log's records (verify reads
    every entry); with ``lenient`` a timeline that cannot be rebuilt is read from the empty state
    (kvctl.history.plan)."""
    where = archive_dir(args)
    if not is_redis(args.log) and where is None:
        return LogView(Base(0), [], None, plain=iter_records(args, until_offset, label))
    pieces: list[Piece] = []
    bases: list[Base] = []
    archive = Archive.open(where) if where is not None else None
    redis_records: RedisRecords | None = None
    progress_flag: bool | None = getattr(args, "progress", None)
    if is_redis(args.log):
        keys = log_keys(args.namespace)
        with log_client(args.log) as client:
            try:
                epoch = log_epoch(client, keys)
            except LogUnavailable as exc:
                raise KvctlError(f"cannot read the log at {args.log}: {exc}") from None
            if archive is not None:
                pieces, bases = archive_part(archive, epoch, live=True)
            after = max((p.hi for p in pieces), default=0)
            piece, checkpoints = redis_part(client, keys, args.log, epoch, after)
        pieces += [piece] if piece is not None else []
        bases += checkpoints

        def from_redis(after: int, until: int) -> Iterator[LogRecord]:
            return _from_redis(args.log, args.namespace, until, label, progress_flag, after, epoch)

        redis_records = live or from_redis
    elif archive is not None:
        pieces, bases = archive_part(archive, None, live=False)
    return plan(pieces, bases, until_offset, earliest, redis_records, lenient)


def redis_part(client: Any, keys: LogKeys, url: str, epoch: str | None, after: int
               ) -> tuple[Piece | None, list[Base]]:
    """The piece of the live log after offset ``after`` (None: nothing) and its usable
    checkpoints; unusable ones are named on stderr when the log needs them (it is trimmed)."""
    import redis  # lazy: only the Redis source needs it

    transient = (redis.ConnectionError, redis.TimeoutError, OSError)
    reader = LogReader(client, keys, transient)
    try:
        first, head = reader.first_offset(), reader.head()
        bases = []
        for c in candidates(keys, lambda names: client.mget(names), epoch, first):
            if c.manifest is not None and c.snapshot is not None:
                at = c.manifest.offset
                bases.append(Base(at, f"checkpoint at offset {at}", c.snapshot, c.manifest.created_ts))
            elif first > 1:
                print(f"kvctl: checkpoint {c.ckpt_id} is unusable ({c.problem})", file=sys.stderr)
    except (*transient, LogUnavailable, redis.ResponseError) as exc:
        raise KvctlError(f"cannot read the log at {url}: {exc}") from None
    lo = max(first, after + 1)
    return (Piece(lo, head) if first > 0 and head >= lo else None), bases


def log_keys(namespace: str) -> LogKeys:
    """The keys of ``namespace``'s log; KvctlError for a name that cannot be one."""
    try:
        return LogKeys(namespace)
    except ValueError as exc:
        raise KvctlError(str(exc)) from None


def log_client(url: str) -> Any:
    """A Redis client for the log at ``url``, with kvctl's timeouts."""
    from rpc import redis_connect  # lazy: only the Redis source needs redis

    return redis_connect.connect(url, socket_connect_timeout=3.0, socket_timeout=30.0)


def log_reader(client: Any, keys: LogKeys) -> LogReader:
    """A reader whose Redis connection errors are LogUnavailable."""
    import redis  # lazy: only the Redis source needs it

    return LogReader(client, keys, (redis.ConnectionError, redis.TimeoutError, OSError))


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
    after: int = 0, epoch: str | None = None,
) -> Iterator[LogRecord]:
    keys = log_keys(namespace)
    client = log_client(url)
    reader = log_reader(client, keys)
    progress: Progress | None = None
    try:
        if epoch is None:
            epoch = log_epoch(client, keys)
        else:
            check_epoch(client, keys, epoch)  # still the log the timeline was planned on
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
