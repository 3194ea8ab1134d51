"""An archive of the log on disk (``kvctl record --follow``): a directory of JSON-lines files,
each an :class:`~events.codec_jsonl.ArchiveHeader` line (the log's epoch, the first offset,
for a file that starts a trimmed log the state before it) and then records in offset order.

Files are named ``{first_offset:012d}-{epoch[:8]}.jsonl`` and rotated by records and bytes. A
file is contiguous; a new one starts on rotation, on a gap (records trimmed before they were
archived) and on a new log epoch. The newest file may end in a line still being written: readers
stop before an unterminated line, the writer cuts it off when it resumes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from events.codec_jsonl import ArchiveHeader, decode_header, decode_record, is_header
from events.schema import LogRecord, SchemaError
from kvctl.errors import KvctlError

SUFFIX = ".jsonl"
_TAIL_READ = 1 << 16


@dataclass(frozen=True)
class Segment:
    """One archive file: its header and the offset of its last complete record (first - 1
    when it has none)."""

    path: Path
    header: ArchiveHeader
    last_offset: int

    @property
    def first_offset(self) -> int:
        return self.header.first_offset

    @property
    def epoch(self) -> str | None:
        return self.header.epoch

    def records(self, after: int = 0, until: int | None = None) -> Iterator[LogRecord]:
        """Its complete records with ``after < offset <= until``; SchemaError names the file,
        line and problem (an offset out of order too)."""
        expect = self.first_offset
        with self.path.open("rb") as fp:
            fp.readline()  # the header
            for lineno, line in enumerate(fp, start=2):
                if not line.endswith(b"\n"):
                    return  # being written
                if not line.strip():
                    continue
                try:
                    record = decode_record(line)
                except SchemaError as exc:
                    raise SchemaError(f"{self.path}: line {lineno}: {exc}") from None
                if record.offset != expect:
                    raise SchemaError(f"{self.path}: line {lineno}: offset {record.offset}, want {expect}")
                expect += 1
                if until is not None and record.offset > until:
                    return
                if record.offset > after:
                    yield record


def file_name(first_offset: int, epoch: str | None) -> str:
    return f"{first_offset:012d}-{(epoch or 'none')[:8]}{SUFFIX}"


def read_segment(path: Path) -> Segment:
    """The file's header and last complete offset; SchemaError when it is not an archive file."""
    with path.open("rb") as fp:
        first = fp.readline()
        if not first.endswith(b"\n") or not is_header(first):
            raise SchemaError(f"{path}: not an archive file (no header line)")
        try:
            header = decode_header(first)
        except SchemaError as exc:
            raise SchemaError(f"{path}: {exc}") from None
        last = _last_line(fp, len(first))
    if last is None:
        return Segment(path, header, header.first_offset - 1)
    try:
        offset = decode_record(last).offset
    except SchemaError as exc:
        raise SchemaError(f"{path}: last line: {exc}") from None
    return Segment(path, header, offset)


def _last_line(fp: IO[bytes], body_start: int) -> bytes | None:
    """The last newline-terminated, non-blank line after the header (None when none)."""
    end = fp.seek(0, os.SEEK_END)
    window = _TAIL_READ
    while True:
        start = max(body_start, end - window)
        fp.seek(start)
        data = fp.read(end - start)
        cut = data.rfind(b"\n")
        lines = [ln for ln in data[: cut + 1].split(b"\n") if ln.strip()] if cut >= 0 else []
        if len(lines) >= 2 or (lines and start == body_start):
            return lines[-1] + b"\n"  # a whole line: another began before it in the window
        if start == body_start:
            return None
        window *= 4


def complete_length(fp: IO[bytes]) -> int:
    """The length of the file up to and including its last newline."""
    pos = fp.seek(0, os.SEEK_END)
    while pos > 0:
        start = max(0, pos - _TAIL_READ)
        fp.seek(start)
        cut = fp.read(pos - start).rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        pos = start
    return 0


class Archive:
    """The segments of an archive directory, by epoch, in offset order."""

    def __init__(self, directory: Path, segments: list[Segment]) -> None:
        self.directory = directory
        self.segments = segments

    @classmethod
    def open(cls, directory: str | Path) -> Archive:
        path = Path(directory)
        if not path.is_dir():
            raise KvctlError(f"no archive directory {path} (write one with 'kvctl record --follow')")
        segments = [read_segment(p) for p in sorted(path.glob("*" + SUFFIX))]
        segments.sort(key=lambda s: (s.header.created_ts, s.first_offset))
        return cls(path, segments)

    def epochs(self) -> list[str | None]:
        """The log epochs archived, oldest first."""
        seen: list[str | None] = []
        for s in self.segments:
            if s.epoch not in seen:
                seen.append(s.epoch)
        return seen

    def of_epoch(self, epoch: str | None) -> list[Segment]:
        """That log's segments in offset order."""
        return sorted((s for s in self.segments if s.epoch == epoch), key=lambda s: s.first_offset)

    def last_offset(self, epoch: str | None) -> int:
        """The last archived offset of that log (0 when none)."""
        return max((s.last_offset for s in self.of_epoch(epoch)), default=0)
