"""``kvctl record``: save a live KV-event stream (ours or any vLLM engine's) as JSON-lines records,
or with ``--log`` archive the durable log itself (kvctl.archiver).

Each received batch becomes one :class:`LogRecord` with ``offset = seq + 1`` (so a recording of
the bridge's mixed stream has the log's own offsets), ``incarnation`` 0 (unfenced) and the
source from the event's ``source`` key, else ``--source-name`` (default: the topic). The file
replays with ``kvctl replay FILE`` like the log itself.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from typing import IO, Any

from events.codec_jsonl import encode_record
from events.codec_vllm import WireBatch
from events.schema import LogRecord
from events.subscriber import KvEventSubscriber, SubscriberError
from kvctl import archiver
from kvctl.args import seconds
from kvctl.errors import KvctlError


def add_stream_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pub", default="tcp://127.0.0.1:5557", help="the PUB endpoint to subscribe to")
    p.add_argument("--replay", default="tcp://127.0.0.1:5558", help="its replay (ROUTER) endpoint")
    p.add_argument("--topic", default="kv-events", help="topic (exact match)")
    p.add_argument("--from-seq", type=int, metavar="N", help="replay from seq N first, then follow")
    p.add_argument("--count", type=int, metavar="N", help="stop after N batches")
    p.add_argument("--duration", type=seconds, metavar="S", help="stop after S seconds")
    p.add_argument("--source-name", help="source for events without a source key (default: topic)")
    p.add_argument("--timeout-s", type=seconds, default=5.0, help="replay reply timeout (seconds)")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "record",
        help="save the live event stream to a JSON-lines file, or archive the log (--log)",
        description="Subscribe to a KV-event stream and write every batch as one log record per "
        "line; gaps are filled from the replay socket. Stops on --count, --duration or Ctrl-C. "
        "With --log, archive the durable log in Redis instead: rotating files in the directory "
        "-o names, resumable (run it again and it continues where it stopped), continuously "
        "with --follow; 'kvctl replay/diff/verify/stats/plot --archive DIR' read the archive and "
        "the live log as one timeline.",
    )
    add_stream_args(p)
    p.add_argument("--out", "-o", required=True, metavar="FILE|DIR",
                   help="output file ('-' = stdout); with --log the archive directory")
    archive = p.add_argument_group("archiving the log (--log)")
    archive.add_argument("--log", metavar="redis://HOST:PORT/DB", help="archive this log")
    archive.add_argument("--namespace", default="default", help="deployment namespace in Redis")
    archive.add_argument("--follow", action="store_true",
                         help="keep archiving new records until SIGTERM/Ctrl-C (or --duration)")
    archive.add_argument("--rotate-records", type=int, default=1_000_000, metavar="N",
                         help="start a new file after N records (default 1000000)")
    archive.add_argument("--rotate-bytes", type=int, default=256 << 20, metavar="B",
                         help="start a new file after B bytes (default 256 MiB)")
    archive.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                         help="progress line on stderr (default: when stderr is a terminal)")
    p.set_defaults(handler=run)


def follow(args: argparse.Namespace, on_batch: Any) -> int:
    """Run a subscriber with ``on_batch(seq, batch)`` until count/duration/Ctrl-C; return batches."""
    if args.count is not None and args.count <= 0:
        raise KvctlError(f"--count must be > 0, got {args.count}")
    sub = KvEventSubscriber(args.pub, args.replay, args.topic, default_source=args.source_name,
                            replay_timeout_s=args.timeout_s)
    seen = 0

    def counted(seq: int, batch: WireBatch) -> None:
        nonlocal seen
        if args.count is None or seen < args.count:
            seen += 1
            on_batch(seq, batch)

    sub.on_batch(counted)
    deadline = None if args.duration is None else time.monotonic() + args.duration
    try:
        if args.from_seq is not None:
            sub.replay_from(args.from_seq)
        while (args.count is None or seen < args.count) and (
            deadline is None or time.monotonic() < deadline
        ):
            sub.poll(100)
    except SubscriberError as exc:
        raise KvctlError(f"{exc} (is kv-bridge running at {args.replay}?)") from None
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
    return seen


def run(args: argparse.Namespace) -> int:
    if args.log:
        return archiver.run(args)
    if args.follow:
        raise KvctlError("--follow archives the log: give --log redis://...")
    out: IO[str] = sys.stdout if args.out == "-" else open(args.out, "w")  # noqa: SIM115
    source_seqs: Counter[str] = Counter()

    def write(seq: int, batch: WireBatch) -> None:
        sources = {s for s in batch.sources if s is not None}
        source = sorted(sources)[0] if sources else (args.source_name or args.topic)
        source_seqs[source] += 1
        record = LogRecord(seq + 1, source, 0, source_seqs[source], batch.ts, batch.events)
        out.write(encode_record(record) + "\n")
        out.flush()

    try:
        n = follow(args, write)
    finally:
        if out is not sys.stdout:
            out.close()
    print(f"kvctl: recorded {n} batches to {args.out}", file=sys.stderr)
    return 0
