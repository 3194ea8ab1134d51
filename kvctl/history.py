"""One timeline over an archive on disk (kvctl.archive, ``kvctl record --follow``) and the live
log in Redis: archived records up to the last one archived, then the live log's.

Where the state can start: at offset 0 when the timeline holds offset 1, or at a checkpoint (the
daemon's in Redis, or one an archive file carries in its header). Offsets in neither the archive
nor the live log (trimmed before they were archived) are a gap: reading jumps over it to the
oldest checkpoint after it and says so on stderr, and :attr:`LogView.gaps` lists it; a gap no
checkpoint bridges ends what can be rebuilt, and asking past it is a KvctlError naming it. The
live log trimmed while it is read is a KvctlError too (run again), never a silent skip.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from events.schema import LogRecord
from events.state import CacheState, Snapshot
from kvctl.archive import Archive, Segment
from kvctl.errors import KvctlError

RedisRecords = Callable[[int, int], Iterator[LogRecord]]
"""``(after, until) -> the live log's records after ``after`` up to ``until``."""

ARCHIVE_HINT = "; to rebuild older states, replay an archive written by 'kvctl record --follow'"


@dataclass(frozen=True)
class Piece:
    """Offsets ``lo..hi``, all held by one archive file (``segment``) or the live log (None)."""

    lo: int
    hi: int
    segment: Segment | None = None


@dataclass(frozen=True)
class Base:
    """A known state at ``offset`` (offset 0 and no snapshot: the empty state)."""

    offset: int
    what: str = ""  # how the output names it
    snapshot: Snapshot | None = None
    created_ts: float | None = None  # when the daemon wrote it (None: not known)


@dataclass
class LogView:
    """The records to apply after ``base`` up to the end asked for; iterating jumps over gaps."""

    start: Base
    steps: list[tuple[Piece, int, int] | tuple[Base, int, int]]
    redis_records: RedisRecords | None
    gaps: list[tuple[int, int]] = field(default_factory=list)  # (first, last) missing offsets
    _state: CacheState | None = None

    plain: Iterator[LogRecord] | None = None  # a file without header: its records as they are
    strict: bool = True  # False: records out of order are the reducer's to report (verify)

    @property
    def base(self) -> Snapshot | None:
        """The state the records follow (None: offset 0)."""
        return self.start.snapshot

    @property
    def note(self) -> str:
        """What the output says about where the state started ('' from offset 1)."""
        return "" if self.start.snapshot is None else f"from {self.start.what}"

    def state(self) -> CacheState:
        """The state the records apply to; a jump over a gap restores it in place."""
        if self._state is None:
            base = self.start.snapshot
            self._state = CacheState() if base is None else CacheState.from_snapshot(base)
        return self._state

    @property
    def records(self) -> Iterator[LogRecord]:
        if self.plain is not None:
            return self.plain
        return self._joined()

    def _joined(self) -> Iterator[LogRecord]:
        expect = self.start.offset + 1
        for step in self.steps:
            what, lo, hi = step
            if isinstance(what, Base):
                assert what.snapshot is not None
                self.gaps.append((lo, hi))
                say(f"offsets {lo}..{hi} are in neither the archive nor the live log (trimmed "
                    f"before they were archived); continuing from the {what.what}")
                self.state().restore(what.snapshot)
                expect = what.offset + 1
                continue
            if what.segment is not None:
                source = what.segment.records(lo - 1, hi)
            else:
                assert self.redis_records is not None
                source = self.redis_records(lo - 1, hi)
            for record in source:
                if record.offset != expect and self.strict:
                    where = "the live log" if what.segment is None else str(what.segment.path)
                    raise KvctlError(f"offset {expect} is gone from {where} (read {record.offset} "
                                     "next): it was trimmed while being read; run the command again")
                expect = record.offset + 1
                yield record
            if expect <= hi and self.strict:
                where = "the live log" if what.segment is None else str(what.segment.path)
                raise KvctlError(f"{where} ended at offset {expect - 1}, before {hi}: it changed "
                                 "while being read; run the command again")


def say(text: str) -> None:
    print(f"kvctl: {text}", file=sys.stderr, flush=True)


def plan(pieces: list[Piece], bases: list[Base], until: int | None, earliest: bool,
         redis_records: RedisRecords | None, lenient: bool = False) -> LogView:
    """The view that rebuilds the state at ``until`` (None: the end) from the newest start
    before it, or with ``earliest`` from the oldest start that reaches it. When none does, a
    KvctlError, or with ``lenient`` every record from the empty state (not strict: the reducer
    reports what is missing)."""
    last = max([p.hi for p in pieces] + [b.offset for b in bases] + [0])
    end = last if until is None else min(until, last)
    starts = ([Base(0)] if any(p.lo == 1 for p in pieces) or last == 0 else []) + sorted(
        bases, key=lambda b: b.offset)
    starts = [s for s in starts if s.offset <= end]
    failures: list[tuple[int, int]] = []
    for start in (starts if earliest else reversed(starts)):
        steps = _walk(pieces, bases, start, end)
        if isinstance(steps, tuple):
            failures.append(steps)
            continue
        view = LogView(start, steps, redis_records, strict=not lenient)
        if earliest:  # history before the start that cannot be rebuilt: said, not hidden
            first = min((p.lo for p in pieces), default=1)
            for lo, hi in failures:
                say(f"offsets {lo}..{hi} are in neither the archive nor the live log: the "
                    f"history from offset {first} before them is not rebuilt")
                view.gaps.append((lo, hi))
        return view
    if lenient:
        return LogView(Base(0), [(p, p.lo, p.hi) for p in sorted(pieces, key=lambda p: p.lo)],
                       redis_records, strict=False)
    raise KvctlError(_unreachable(pieces, bases, end, failures))


def _walk(pieces: list[Piece], bases: list[Base], start: Base, end: int
          ) -> list[tuple[Piece, int, int] | tuple[Base, int, int]] | tuple[int, int]:
    """Steps from ``start`` to ``end``, or the first gap (first, last) no base bridges."""
    steps: list[tuple[Piece, int, int] | tuple[Base, int, int]] = []
    pos = start.offset
    while pos < end:
        piece = next((p for p in pieces if p.lo <= pos + 1 <= p.hi), None)
        if piece is not None:
            hi = min(piece.hi, end)
            steps.append((piece, pos + 1, hi))
            pos = hi
            continue
        gap_hi = min((p.lo for p in pieces if p.lo > pos + 1), default=end + 1) - 1
        bridge = [b for b in bases if gap_hi <= b.offset <= end
                  and (b.offset == end or any(p.lo <= b.offset + 1 <= p.hi for p in pieces))]
        if not bridge:
            return (pos + 1, gap_hi)
        base = min(bridge, key=lambda b: b.offset)
        steps.append((base, pos + 1, gap_hi))
        pos = base.offset
    return steps


def _unreachable(pieces: list[Piece], bases: list[Base], end: int, failures: list[tuple[int, int]]) -> str:
    first = min((p.lo for p in pieces), default=0)
    gap = max(failures, default=None)
    after = [b.offset for b in bases if gap is None or b.offset >= gap[1]]
    if gap is not None and gap[0] > first:
        msg = (f"offset {end} cannot be rebuilt: offsets {gap[0]}..{gap[1]} are in neither the "
               "archive nor the live log and no checkpoint after them reaches it")
    else:
        msg = f"offset {end} cannot be rebuilt: the log starts at offset {first}"
        if not after:
            msg += " and no usable checkpoint covers the records before it"
    if after:
        msg += f" and the oldest checkpoint is at offset {min(after)}, the oldest offset it can rebuild"
    return msg + ARCHIVE_HINT


def archive_part(archive: Archive, epoch: str | None, live: bool) -> tuple[list[Piece], list[Base]]:
    """The archive's pieces and checkpoints of the log of ``epoch`` (with ``live`` False and no
    such log archived, of the newest log it holds)."""
    epochs = archive.epochs()
    if not live and epoch not in epochs and epochs:
        epoch = epochs[-1]
    others = [e for e in epochs if e != epoch]
    if others:
        say(f"the archive also holds other logs (epochs {', '.join(map(str, others))}); reading "
            f"epoch {epoch}")
    pieces, bases = [], []
    for seg in archive.of_epoch(epoch):
        if seg.last_offset >= seg.first_offset:
            pieces.append(Piece(seg.first_offset, seg.last_offset, seg))
        if seg.header.base is not None:
            at = seg.header.base.offset
            bases.append(Base(at, f"archived checkpoint at offset {at}", seg.header.base))
    return pieces, bases
