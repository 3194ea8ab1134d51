"""Which segments of a tier's previous cut a removal touched, and what to cut again around them
(issue 17, checkpoint cost; DECISIONS 68).

A tier's segments (events.checkpoint_cut) are cut by content in insertion order, and a boundary
depends only on the blocks since the previous one. A removal leaves a hole in its segment and
moves every later block one place down; a hash stored again changes its segment in place. So
after such changes a segment that lost nothing and changed nothing is still a segment of the
tier, at a position known from the counts lost before it, *as long as the cut reaches its start
as a boundary again*. The plan (:func:`plan`) walks the previous cut's segments in order: a
clean one is kept (its end moved down by what its predecessors lost); from a dirty one the cut
starts again and runs until it ends a segment exactly where a kept segment begins (then the two
cuts agree from there on), or to the tier's end. The previous cut's last segment is always cut
again, with what was appended (as for a tier that only grew).

Which segment a changed hash was in comes from the checkpoint writer's map ``hash -> the
fingerprint of its segment`` (events.checkpoint_book.CutBook): per change one look-up, never a
walk of the tier. The keys and values of what is cut again before the last stretch are copied
at the export's instant with C-speed forward passes over the tier (:class:`_Forward`), skipping
what is kept; the last stretch (the tail: the previous last segment, or a dirty one before it,
and what was appended) is left to the export, which copies it at its instant or reads it after
(offloadd.log.later_read, DECISIONS 81).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Generic, TypeVar

from events.checkpoint_cut import Cuts, Piece, segments
from events.schema import BlockStored
from events.state_tier import Tier

T = TypeVar("T")
Touched = Counter[bytes]  # per segment (its fingerprint): blocks it lost (0: changed in place)


@dataclass(frozen=True)
class Stretch:
    """A run of one tier in an export: pieces kept as they were (their ``end``s as now), then
    the blocks ``[start, end)`` to cut: copied at the export's instant (``keys``, ``values``),
    or, for a tier's last stretch only, left to be read from the live tier (None)."""

    kept: tuple[Piece, ...]
    start: int
    end: int
    keys: list[int] | None = None
    values: list[BlockStored] | None = None


def plan(tier: Tier, previous: Sequence[Piece], touched: Touched, present: Container[str],
         cuts: Cuts, limit: int | None = None) -> list[Stretch] | None:
    """The stretches of an export of ``tier`` now (module docstring), given the previous cut
    (``previous``, its pieces in order) and ``touched``: per fingerprint of a piece of it, the
    blocks it lost since (0: one changed in place). None when that does not fit the cut (the
    tier must be cut whole), or when more than ``limit`` blocks would be cut."""
    index = {p.fingerprint: i for i, p in enumerate(previous)}
    m = len(previous)
    lost, dirty = [0] * m, [False] * m
    for fp, num in touched.items():
        i = index.get(fp)
        if i is None:
            return None  # a map that does not match the cut: never guess
        dirty[i] = True
        lost[i] += num
    ends, total, before = list[int](), 0, 0
    for i, p in enumerate(previous):
        size, before = p.end - before, p.end
        if lost[i] > size:
            return None
        total += size - lost[i]
        ends.append(total)
        dirty[i] = dirty[i] or p.address not in present  # a chunk Redis lost is cut again
    n = len(tier)
    if n < total:
        return None  # fewer blocks than the cut's survivors: changes were missed
    dirty[-1] = True  # the last segment: cut again with what was appended
    if limit is not None:
        sizes = (e - (ends[i - 1] if i else 0) for i, e in enumerate(ends))
        if sum(s for s, d in zip(sizes, dirty, strict=True) if d) + n - total > limit:
            return None
    return _walk(tier, previous, ends, dirty, cuts)


def _walk(tier: Tier, previous: Sequence[Piece], ends: list[int], dirty: list[bool],
          cuts: Cuts) -> list[Stretch]:
    m, n = len(previous), len(tier)
    keys, values = _Forward(iter(tier)), _Forward(iter(tier.values()))
    # Where a cut begun again meets the previous one: a segment ending at a kept one's start.
    resume: dict[int, int] = {}
    for k in range(m - 2):
        if not dirty[k + 1]:
            resume[ends[k]] = k + 1
    out: list[Stretch] = []
    kept: list[Piece] = []
    i = pos = 0
    while i < m - 1:
        if not dirty[i]:
            p = previous[i]
            kept.append(Piece(p.address, p.length, p.fingerprint, None, ends[i]))
            pos, i = ends[i], i + 1
            continue
        keys.release(pos)
        values.release(pos)
        stop, i = _cut_until(keys, pos, n, resume, m, cuts)
        if stop == n:  # never met the previous cut again: this is the tail
            break
        out.append(Stretch(tuple(kept), pos, stop, keys.slice(pos, stop), values.slice(pos, stop)))
        kept, pos = [], stop
    if pos < n or kept:
        out.append(Stretch(tuple(kept), pos, n))  # the tail: read where the export reads it
    return out


def _cut_until(keys: _Forward[int], pos: int, n: int, resume: Mapping[int, int], m: int,
               cuts: Cuts) -> tuple[int, int]:
    """Cut from ``pos`` (events.checkpoint_cut.segments' rule) until a segment ends where
    ``resume`` says a kept segment begins: (that position, that segment's index); else
    (the tier's end, ``m``)."""
    s = pos
    while s < n:
        window = keys.slice(s, min(s + cuts.max, n))  # the next segment lies within
        s += next(segments(window, cuts))[1]
        k = resume.get(s)
        if k is not None:
            return s, k
    return n, m


def copy_from(tier: Tier, start: int) -> tuple[list[int], list[BlockStored]]:
    """The tier's keys and values from position ``start`` on, read from its end."""
    if start == 0:
        return list(tier), list(tier.values())
    n = len(tier) - start
    keys = list(islice(reversed(tier), n))
    values = list(islice(reversed(tier.values()), n))
    keys.reverse()
    values.reverse()
    return keys, values


class _Forward(Generic[T]):
    """A tier's keys or values by position, read forward once at C speed: ``slice(a, b)``
    for any ``a`` not before the last ``release``; what lies between is skipped."""

    def __init__(self, it: Iterator[T]) -> None:
        self._it = it
        self._buf: list[T] = []
        self._at = 0  # the position of _buf[0]

    def release(self, a: int) -> None:
        """Positions before ``a`` are not asked for again."""
        have = self._at + len(self._buf)
        if a >= have:
            deque(islice(self._it, a - have), maxlen=0)
            self._buf, self._at = [], a
        elif a > self._at:
            del self._buf[: a - self._at]
            self._at = a

    def slice(self, a: int, b: int) -> list[T]:
        assert a >= self._at, "a position released before"
        need = b - self._at - len(self._buf)
        if need > 0:
            self._buf.extend(islice(self._it, need))
        return self._buf[a - self._at: b - self._at]
