"""``kvctl record --log redis://... -o DIR [--follow]``: archive the durable log to rotating
files (kvctl.archive), continuously with ``--follow``.

Resumable: a restarted archiver cuts off a line it was writing and continues after the last
record it archived, so the archive has neither duplicates nor holes of its own. Records trimmed
before they were archived (the archiver was down longer than the log's retention) are a gap:
reported on stderr, and the next file starts after the daemon's oldest usable checkpoint with
its state in the header, so the archive can rebuild state again from there. A new log epoch (the
log was lost and started afresh) starts new files under that epoch.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import IO, Any

from events.checkpoint import candidates
from events.codec_jsonl import ARCHIVE_VERSION, ArchiveHeader, encode_header, encode_record
from events.logkeys import LogKeys
from events.logreader import LogUnavailable
from events.schema import LogRecord
from events.state import Snapshot
from kvctl.archive import Archive, complete_length, file_name
from kvctl.errors import KvctlError
from kvctl.logsource import log_client, log_epoch, log_keys, log_reader
from kvctl.progress import Progress


class ArchiveWriter:
    """Appends records to an archive directory, one contiguous file at a time."""

    def __init__(self, directory: Path, namespace: str, rotate_records: int, rotate_bytes: int) -> None:
        self._dir = directory
        self._namespace = namespace
        self._rotate_records, self._rotate_bytes = rotate_records, rotate_bytes
        self._fp: IO[bytes] | None = None
        self._path: Path | None = None
        self._records = 0  # in the current file since it was opened
        self._bytes = 0

    def resume(self, epoch: str | None) -> int:
        """Continue the newest file of that log (cutting off an unterminated last line); the
        last offset archived (0: none)."""
        self.close()
        segments = Archive.open(self._dir).of_epoch(epoch)
        if not segments:
            return 0
        last = segments[-1]
        with last.path.open("r+b") as fp:
            end = fp.seek(0, os.SEEK_END)
            keep = complete_length(fp)
            if keep < end:
                say(f"cut off {end - keep} bytes of an unfinished line at the end of {last.path}")
                fp.truncate(keep)
        self._fp, self._path = last.path.open("ab"), last.path
        self._records, self._bytes = 0, last.path.stat().st_size
        return last.last_offset

    def start(self, first_offset: int, epoch: str | None, base: Snapshot | None = None) -> Path:
        """A new file whose first record will be ``first_offset``; a current file without
        records is removed (nothing would read it)."""
        if self._fp is not None and self._path is not None and self._records == 0 and self._is_empty():
            self._fp.close()
            self._path.unlink()
            self._fp = None
        self.close()
        header = ArchiveHeader(ARCHIVE_VERSION, self._namespace, epoch, first_offset, time.time(), base)
        path = self._dir / file_name(first_offset, epoch)
        if path.exists():
            raise KvctlError(f"{path} exists already: is another archiver writing to {self._dir}?")
        line = (encode_header(header) + "\n").encode()
        staging = path.with_name(f".{path.name}.tmp")  # a file appears with its whole header
        with staging.open("wb") as fp:
            fp.write(line)
            os.fsync(fp.fileno())
        staging.rename(path)
        self._fp, self._path, self._records, self._bytes = path.open("ab"), path, 0, len(line)
        return path

    def append(self, record: LogRecord, epoch: str | None) -> None:
        if self._fp is None or self._records >= self._rotate_records or self._bytes >= self._rotate_bytes:
            self.start(record.offset, epoch)
        assert self._fp is not None
        line = (encode_record(record) + "\n").encode()
        self._fp.write(line)
        self._records += 1
        self._bytes += len(line)

    def flush(self) -> None:
        if self._fp is not None:
            self._fp.flush()

    def close(self) -> None:
        if self._fp is not None:
            self._fp.flush()
            os.fsync(self._fp.fileno())
            self._fp.close()
            self._fp = None

    def _is_empty(self) -> bool:
        assert self._fp is not None and self._path is not None
        self._fp.flush()
        with self._path.open("rb") as fp:
            fp.readline()
            return not fp.read(1)


class Archiver:
    """The follow loop: poll the log after the last archived offset and append."""

    def __init__(self, args: argparse.Namespace, client: Any, keys: LogKeys) -> None:
        self._args, self._client, self._keys = args, client, keys
        self._reader = log_reader(client, keys)
        self._writer = ArchiveWriter(Path(args.out), keys.namespace, args.rotate_records, args.rotate_bytes)
        self._stop = False
        self._progress = Progress("archiving", None, "records", False)
        self.archived = 0
        self.gaps = 0

    def stop(self, _signum: int = 0, _frame: FrameType | None = None) -> None:
        self._stop = True

    def run(self) -> None:
        args = self._args
        deadline = None if args.duration is None else time.monotonic() + args.duration
        epoch = log_epoch(self._client, self._keys)
        last = self._writer.resume(epoch)
        until = None if args.follow else self._reader.head()
        say(f"archiving log '{self._keys.namespace}' (epoch {epoch}) to {args.out} after offset {last}"
            + ("" if args.follow else f" up to offset {until}"))
        down_since: float | None = None
        total = None if until is None else max(0, until - last)
        self._progress = Progress("archiving", total, "records", getattr(args, "progress", None))
        try:
            while not self._stop and (deadline is None or time.monotonic() < deadline):
                if until is not None and last >= until:
                    break
                try:
                    records = self._reader.poll(last, 500 if args.follow else 0, count=1000)
                    now = log_epoch(self._client, self._keys)
                except LogUnavailable as exc:
                    if down_since is None:
                        down_since = time.monotonic()
                        say(f"redis unavailable ({exc}); retrying")
                    time.sleep(0.5)
                    continue
                if down_since is not None:
                    say(f"redis back after {time.monotonic() - down_since:.1f} s")
                    down_since = None
                if now != epoch:
                    say(f"the log's epoch changed from {epoch} to {now}: a new log began; "
                        "archiving it to new files")
                    epoch, last = now, self._writer.resume(now)
                    continue
                if not records and until is not None:
                    break  # the log ends before the head read at start (trimmed): done
                last = self._append(records, last, epoch)
        finally:
            self._writer.close()
            self._progress.close()

    def _append(self, records: list[LogRecord], last: int, epoch: str | None) -> int:
        for record in records:
            if record.offset != last + 1:
                return self._restart(record.offset, last, epoch)
            self._writer.append(record, epoch)
            last = record.offset
            self.archived += 1
            self._progress.advance()
        self._writer.flush()
        return last

    def _restart(self, seen: int, last: int, epoch: str | None) -> int:
        """The log no longer holds ``last + 1``: start a file after the oldest usable
        checkpoint (its state in the header) or, with none, at ``seen``; the new last offset."""
        self._writer.flush()
        first = self._reader.first_offset()
        usable = [c for c in candidates(self._keys, self._client.mget, epoch, first)
                  if c.manifest is not None and c.snapshot is not None]
        pick = min(usable, key=lambda c: c.manifest.offset if c.manifest else 0, default=None)
        resume = seen if pick is None or pick.manifest is None else pick.manifest.offset + 1
        if last > 0:
            self.gaps += 1
            say(f"gap: offsets {last + 1}..{resume - 1} were trimmed from the log before they "
                "were archived")
        else:
            say(f"the log starts at offset {first} (older records trimmed)")
        if pick is None:
            say(f"no usable checkpoint: offsets from {seen} are archived without the state before them")
            self._writer.start(seen, epoch)
            return seen - 1
        say(f"archiving from the checkpoint at offset {resume - 1} (its state is in the file's header)")
        self._writer.start(resume, epoch, pick.snapshot)
        return resume - 1


def say(text: str) -> None:
    print(f"kvctl record: {text}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.out == "-":
        raise KvctlError("with --log, -o names the archive directory ('-' is not one)")
    if args.rotate_records <= 0 or args.rotate_bytes <= 0:
        raise KvctlError("--rotate-records and --rotate-bytes must be > 0")
    keys = log_keys(args.namespace)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    client = log_client(args.log)
    archiver = Archiver(args, client, keys)
    previous = signal.signal(signal.SIGTERM, archiver.stop)
    try:
        archiver.run()
    except LogUnavailable as exc:
        raise KvctlError(f"cannot read the log at {args.log}: {exc}") from None
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        client.close()
    say(f"archived {archiver.archived} records to {args.out}"
        + (f"; {archiver.gaps} gaps (see above)" if archiver.gaps else ""))
    return 0
