"""A tier's tail read after a checkpoint export's instant, in the loop, instead of copied at it
(DECISIONS 74, 81).

An export in the loop must cut the state of its instant while the reducer goes on applying
records. Copying the blocks to cut at the instant costs ~40 ns a block in one slice of the loop
(4-6 ms for the 100-130k blocks a GPU tier appends between two checkpoints). The last stretch
of a tier (its tail: from the previous cut's last segment, or a dirty one before it, to the
end) is instead read when its turn comes, a window at a time, from the live tier, for as long
as the tier's changes since the instant leave the tail's blocks where they were.

Where they were: the tier is a dict in insertion order with no index, so a window is read by
its position counted from the tier's end. A block's position from the end changes only when a
block after it comes or goes. Appends come after every tail block and are counted by the
tier's length. A removal of a block before the tail shortens the tier without moving the
tail's positions from the end. So the instant's position ``p`` is at ``len + shift - 1 - p``
from the end, where ``shift`` counts the blocks before the tail removed since the instant.
Anything else gives the export up (:class:`TierMoved`): a block of the tail, or one appended
since, removed or stored again (a window's events are looked up by hash, valid only while
each tail hash maps to the instant's event); a hash removed twice; the tier cleared or replaced.

Which removed hash lay before the tail: the checkpoint writer's map of the previous cut
(events.checkpoint_book.CutBook, hash -> its segment's fingerprint, as the export's earlier
pieces re-map them) places it in a segment, and the tail's segments are exactly those whose
pieces this export had not produced when the tail's read began (``before``: the pieces kept,
and those cut in the stretches before it). A hash the map does not hold was appended since the
previous cut, so it lies in the tail or after it: the export is given up. A tier with no map
(cut whole: a first export, or one whose changes the book could not place) has nothing before
its tail, so any change gives it up: an append-only tier keeps its rule of DECISIONS 74.

A given-up export leaves the previous checkpoint in force; the writer copies every tail at the
instant in its next export (offloadd.log.checkpoint), so a tier that keeps changing under its
reads still gets checkpointed.
"""

from __future__ import annotations

from array import array
from collections.abc import AsyncGenerator, Callable, Container, Mapping
from itertools import islice
from typing import NamedTuple, NoReturn

from events.checkpoint_cut import Cuts, Piece, cut_segments, cut_tail, segments
from events.checkpoint_delta import TierId, TierTail
from events.schema import BlockStored
from events.state_changes import TierChanges


class Later(NamedTuple):
    """What an export in the loop may read after its instant: the tiers, each tier's changes
    since the instant (CacheState.pending_changes by tier id: the export took those before it),
    the writer's map of each tier's hashes to their segments' fingerprints (CutBook.maps), and
    how many blocks it reads per slice (Checkpointer.read_window)."""

    tiers: Container[TierId]
    changes: Callable[[TierId], TierChanges | None]
    maps: Callable[[TierId], Mapping[int, bytes] | None]
    window: int


class TierMoved(Exception):
    """A tier read after the export's instant changed so that the instant's tail is no longer
    known to be where it was (module docstring): this export is given up; the next one copies
    it at its instant."""


class TailWatch:
    """The changes of one tier since an export's instant, as its tail is read (module docstring):
    :meth:`shift` after each batch of them, or TierMoved."""

    def __init__(self, part: TierTail, later: Later, before: set[bytes]) -> None:
        self._part = part
        self._later = later
        self._before = before  # fingerprints of the segments before the tail
        self._journal: TierChanges | None = None
        self._removed = 0  # how much of the journal's lists was seen
        self._rewritten = 0
        self._gone: set[int] = set()  # hashes before the tail removed since the instant

    def shift(self, length_now: int) -> int:
        """Blocks before the tail removed since the instant, the tier being ``length_now``
        long; TierMoved when a change since leaves the tail's positions unknown."""
        tid = self._part.tier
        journal = self._later.changes(tid)
        if journal is not None:
            if self._journal is None:
                self._journal = journal
            if journal is not self._journal or journal.reset:
                self._moved("was cleared or replaced")
            seg_of = self._later.maps(tid)
            removed, rewritten = journal.removed, journal.rewritten
            for h in islice(removed, self._removed, None):
                if h in self._gone or not self._is_before(seg_of, h):
                    self._moved("lost a block of its tail or after it")
                self._gone.add(h)
            for h in islice(rewritten, self._rewritten, None):
                if h in self._gone or not self._is_before(seg_of, h):
                    self._moved("had a block of its tail or after it stored again")
            self._removed, self._rewritten = len(removed), len(rewritten)
        elif self._journal is not None:
            self._moved("had its changes taken by another reader")
        shift = len(self._gone)
        if length_now + shift < self._part.length:
            self._moved("is shorter than its tail")
        return shift

    def _is_before(self, seg_of: Mapping[int, bytes] | None, h: int) -> bool:
        fp = None if seg_of is None else seg_of.get(h)
        return fp is not None and fp in self._before

    def _moved(self, what: str) -> NoReturn:
        raise TierMoved(f"tier {self._part.tier} {what} during the export; this checkpoint is "
                        "given up, the next one copies it at its instant")


async def cut_later(part: TierTail, later: Later, cuts: Cuts, known: Mapping[bytes, tuple[str, int]],
                    present: Container[str]) -> AsyncGenerator[Piece | None, None]:
    """``part``'s pieces, its uncopied tail read from the live tier a window at a time, each
    window read while :class:`TailWatch` places it and cut at once (the segments it completes;
    the last, maybe incomplete, waits for the next window: a boundary depends only on the
    blocks since the previous one, so the cut is the whole stretch's). Only the window's hashes
    are read by position (~9 ns a block skipped from the end: the dict has no index); its
    events are looked up by hash. A window read is a slice of its own: None is yielded after
    it, a point where the caller may pause before the window's segments are cut."""
    tier = part.live
    assert tier is not None
    source, medium, group = part.tier
    before: set[bytes] = set()
    watch = TailWatch(part, later, before)
    for stretch in part.stretches:
        for piece in stretch.kept:
            before.add(piece.fingerprint)
            yield piece
        if stretch.keys is not None and stretch.values is not None:
            for piece in cut_tail(source, medium, group, stretch.start, stretch.keys, stretch.values,
                                  cuts, known, present):
                before.add(piece.fingerprint)
                yield piece
            continue
        base = pos = stretch.start  # base: the position of keys[0], a segment's start
        keys: list[int] = []
        values: list[BlockStored] = []
        while pos < stretch.end:
            n = min(later.window, stretch.end - pos)
            # From the end: what was appended since, and after pos + n (module docstring).
            skip = len(tier) + watch.shift(len(tier)) - pos - n
            run = list(islice(reversed(tier), skip, skip + n))
            run.reverse()
            keys += run
            values += map(tier.__getitem__, run)
            pos += n
            yield None  # the window is the instant's whatever the tier does from here on
            packed = array("Q", keys)
            bounds = list(segments(packed, cuts))
            if pos < stretch.end:
                bounds.pop()  # the last may go on in the next window
            for piece in cut_segments(source, medium, group, base, keys, values, packed, bounds,
                                      known, present):
                yield piece
            done = bounds[-1][1] if bounds else 0
            del keys[:done], values[:done]
            base += done
