"""``kvctl tail``: print a live KV-event stream, one human-readable line per event."""

from __future__ import annotations

import argparse
import sys
import time
from datetime import UTC, datetime
from typing import Any

from events.codec_vllm import WireBatch
from events.logreader import LogUnavailable
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvctl.errors import KvctlError
from kvctl.logsource import check_epoch, log_client, log_epoch, log_keys, log_reader
from kvctl.record import add_stream_args, follow


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "tail",
        help="follow the live event stream, human-readable",
        description="Subscribe to a KV-event stream and print every event as it arrives "
        "(gaps are filled from the replay socket), or with --log follow the log in Redis "
        "itself (no bridge needed). Stops on --count, --duration or Ctrl-C.",
    )
    add_stream_args(p)
    p.add_argument("--log", metavar="redis://HOST:PORT/DB", help="follow this log instead")
    p.add_argument("--namespace", default="default", help="with --log: deployment namespace")
    p.add_argument("--from-offset", type=int, metavar="N", help="with --log: start at offset N "
                   "(default: the next record appended)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.log:
        return _tail_log(args)

    def show(seq: int, batch: WireBatch) -> None:
        when = _clock(batch.ts)
        for event, source in zip(batch.events, batch.sources, strict=True):
            src = source or args.source_name or args.topic
            print(f"seq {seq}  {when}  {src}  {describe(event)}")
        sys.stdout.flush()

    follow(args, show)
    return 0


def _tail_log(args: argparse.Namespace) -> int:
    keys = log_keys(args.namespace)
    client = log_client(args.log)
    reader = log_reader(client, keys)
    deadline = None if args.duration is None else time.monotonic() + args.duration
    shown = 0
    try:
        epoch = log_epoch(client, keys)
        print(f"log epoch {epoch}", file=sys.stderr)
        after = reader.head() if args.from_offset is None else max(0, args.from_offset - 1)
        while (args.count is None or shown < args.count) and (
            deadline is None or time.monotonic() < deadline
        ):
            records = reader.poll(after, 100, count=100)
            check_epoch(client, keys, epoch)  # a new log restarts at offset 1: stop, say so
            for record in records:
                after = record.offset
                if args.count is not None and shown >= args.count:
                    break
                shown += 1
                for event in record.events:
                    print(f"offset {record.offset}  {_clock(record.ts)}  {record.source}  "
                          f"{describe(event)}")
            sys.stdout.flush()
    except LogUnavailable as exc:
        raise KvctlError(f"cannot read the log at {args.log}: {exc}") from None
    except KeyboardInterrupt:
        pass
    finally:
        client.close()
    return 0


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%H:%M:%S.%f")[:-3]


def describe(event: Event) -> str:
    if isinstance(event, BlockStored):
        hashes = _hashes(event.block_hashes)
        parent = "none" if event.parent_block_hash is None else str(event.parent_block_hash)
        extra = f" lora={event.lora_name}" if event.lora_name else ""
        return (
            f"BlockStored {event.medium} g{event.group_idx} {len(event.block_hashes)} blocks "
            f"[{hashes}] parent={parent} tokens={len(event.token_ids)}{extra}"
        )
    if isinstance(event, BlockRemoved):
        return (
            f"BlockRemoved {event.medium} g{event.group_idx} {len(event.block_hashes)} blocks "
            f"[{_hashes(event.block_hashes)}]"
        )
    assert isinstance(event, AllBlocksCleared)
    return f"AllBlocksCleared {event.medium or 'all tiers'}"


def _hashes(hashes: tuple[int, ...]) -> str:
    if len(hashes) <= 3:
        return " ".join(str(h) for h in hashes)
    return f"{hashes[0]} {hashes[1]} ... {hashes[-1]}"
