"""``kvctl repair --drop-foreign``: remove what the daemon did not write from a namespace.

It asks no questions but prints every change: log entries that are not records (XDEL), the
stream's last ID put back on the last record (XSETID, so the daemon's next XADD is accepted
after a foreign entry with a higher ID was removed), a head key that does not name the last
record, and keys of the daemon's hashes that are of the wrong type (DEL) or hold fields that
are not msgpack arrays (HDEL). The daemon's own decoders are stricter; what it still refuses,
its start-up line names. Refuses while a daemon holds the namespace's owner lease (--force:
at your own risk; the daemon's writes are fenced, not its reads).
"""

from __future__ import annotations

import argparse
from typing import Any

import msgspec

from events.logkeys import LogKeys
from events.logreader import LogReader, LogUnavailable, decode_stored
from events.records import entry_id
from events.schema import SchemaError
from kvctl.errors import KvctlError
from kvctl.logsource import log_client, log_keys


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "repair",
        help="remove foreign data (entries that are not records, garbage keys) from a namespace",
        description=__doc__,
    )
    p.add_argument("log", metavar="redis://HOST:PORT/DB", help="the Redis holding the namespace")
    p.add_argument("--namespace", default="default", help="deployment namespace in Redis")
    p.add_argument("--drop-foreign", action="store_true", required=True,
                   help="delete foreign log entries and garbage keys/fields; fix the head key")
    p.add_argument("--force", action="store_true",
                   help="repair even while a daemon holds the namespace's owner lease")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import redis  # lazy, like every Redis source of kvctl

    keys = log_keys(args.namespace)
    client: Any = log_client(args.log)
    try:
        owner = client.get(keys.owner) if client.type(keys.owner) == b"string" else None
        if owner is not None and not args.force:
            raise KvctlError(f"a daemon owns namespace {args.namespace!r} (lease "
                             f"{owner.decode(errors='replace')!r}); stop it first, or --force")
        changes = _repair_keys(client, keys) + _repair_log(client, keys)
    except (redis.RedisError, LogUnavailable) as exc:
        raise KvctlError(f"cannot repair {args.log}: {exc}") from None
    finally:
        client.close()
    for line in changes:
        print(f"repair: {line}")
    print(f"repair: {len(changes)} changes" if changes else "repair: nothing to repair")
    return 0


def _repair_log(client: Any, keys: LogKeys) -> list[str]:
    changes: list[str] = []
    if client.type(keys.log) not in (b"stream", b"none"):
        client.delete(keys.log)
        return [f"deleted {keys.log}: not a stream"]
    reader = LogReader(client, keys)
    last = 0
    for eid, fields in list(reader.iter_entries()):
        try:
            last = decode_stored(eid, fields).offset
        except SchemaError as exc:
            client.xdel(keys.log, eid)
            changes.append(f"removed {exc}")
    if client.exists(keys.log):
        info = client.xinfo_stream(keys.log)
        want = entry_id(last) if last else "0-0"
        if info["last-generated-id"] != want.encode():
            client.execute_command("XSETID", keys.log, want)
            changes.append(f"stream last ID {info['last-generated-id'].decode()} -> {want}")
    head = client.get(keys.head)
    if head != str(last).encode() and (head is not None or last):
        client.set(keys.head, last)
        changes.append(f"head {keys.head} {head!r} -> {last}")
    return changes


def _repair_keys(client: Any, keys: LogKeys) -> list[str]:
    changes: list[str] = []
    if client.type(keys.head) not in (b"string", b"none"):
        client.delete(keys.head)
        changes.append(f"deleted {keys.head}: not a string")
    for key in (keys.daemon, keys.sources, keys.layouts, keys.engines):
        kind = client.type(key)
        if kind not in (b"hash", b"none"):
            client.delete(key)
            changes.append(f"deleted {key}: a {kind.decode()}, not a hash")
            continue
        for field, value in client.hgetall(key).items():
            if not _is_value(key == keys.daemon, value):
                client.hdel(key, field)
                changes.append(f"removed field {field!r} of {key}: {value[:40]!r}")
    return changes


def _is_value(is_text: bool, value: bytes) -> bool:
    if is_text:
        try:
            value.decode()
        except UnicodeDecodeError:
            return False
        return True
    try:
        return isinstance(msgspec.msgpack.decode(value), list)
    except msgspec.DecodeError:
        return False
