"""Where kvctl reads log records from: a JSON-lines file (``kvctl record``, exports) or the live
log in Redis (``redis://...`` with ``--namespace``). kvctl is an entry point, so it may create
the Redis client (DESIGN.md 5); the import is lazy so file-only use needs no Redis.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from typing import Any

from events.codec_jsonl import load_records
from events.logkeys import LogKeys
from events.logreader import LogReader, LogUnavailable
from events.schema import LogRecord
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


def iter_records(
    args: argparse.Namespace, until_offset: int | None = None, label: str = "reading"
) -> Iterator[LogRecord]:
    """Records of ``args.log`` in offset order, up to ``until_offset`` when given."""
    progress_flag: bool | None = getattr(args, "progress", None)
    if is_redis(args.log):
        yield from _from_redis(args.log, args.namespace, until_offset, label, progress_flag)
    else:
        yield from _from_file(args.log, until_offset, label, progress_flag)


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
    url: str, namespace: str, until: int | None, label: str, progress_flag: bool | None
) -> Iterator[LogRecord]:
    import redis  # lazy: only the Redis source needs it

    try:
        keys = LogKeys(namespace)
    except ValueError as exc:
        raise KvctlError(str(exc)) from None
    client = redis.Redis.from_url(url, socket_connect_timeout=3.0, socket_timeout=30.0)
    reader = LogReader(client, keys, (redis.ConnectionError, redis.TimeoutError, OSError))
    progress: Progress | None = None
    try:
        epoch = log_epoch(client, keys)
        head = reader.head()
        total = head if until is None else min(head, until)
        progress = Progress(label, total, "records", progress_flag)
        for n, record in enumerate(reader.iter_range(1, total), start=1):
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
