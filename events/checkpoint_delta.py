"""A checkpoint that cuts only what changed since the previous one (issue 17, checkpoint cost).

events.checkpoint_cut cuts each tier of CacheState into content-defined segments in insertion
order; a boundary depends only on the blocks since the previous boundary. So when a tier only
grew since the previous export (``CacheState.edits`` unchanged: no block removed or stored
again, the tier neither cleared nor replaced), every segment of that export but its last is a
segment of the tier now, at the same positions, with the same blocks and the same events: its
chunk is reused as it was, without a look at its blocks. Only the blocks from the previous last
segment's start to the tier's end are cut again. A tier that changed otherwise is cut whole, as
before (the fingerprints of the previous export still spare re-encoding its unchanged
segments). The work of a checkpoint is then what was appended, not the resident state.

The blocks cut again are copied at the checkpoint's instant from the tier's end
(``reversed``: C speed, the rest of the tier is never visited), so the copy may be cut later,
while the state moves on: in the daemon's loop in slices, or in a forked child.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping
from dataclasses import dataclass, replace
from itertools import islice

from events.checkpoint_cut import Cuts, Piece, cut_tail
from events.schema import BlockStored, Medium
from events.state import CacheState
from events.state_tier import Tier

TierId = tuple[str, Medium, int]  # (source, medium, group_idx)


@dataclass(frozen=True)
class TierCut:
    """One tier as the previous export left it: the reducer's edit count then, and its
    pieces (no bytes), whose ``end``s ascend to the tier's length then."""

    edits: int
    pieces: tuple[Piece, ...]

    @property
    def length(self) -> int:
        return self.pieces[-1].end if self.pieces else 0


@dataclass(frozen=True)
class TierTail:
    """One tier's part of an export: the pieces kept as they were, then the blocks from
    ``start`` (the first position ``kept`` does not cover) to ``length``, the tier's length at
    the export's instant: copied then (``keys``, ``values``), or read from ``live`` by whoever
    holds the state of that instant (a forked child)."""

    tier: TierId
    edits: int
    kept: tuple[Piece, ...]
    start: int
    length: int
    live: Tier | None = None
    keys: list[int] | None = None
    values: list[BlockStored] | None = None

    @property
    def todo(self) -> int:
        """Blocks to cut."""
        return self.length - self.start

    def copied(self) -> TierTail:
        """This part with its blocks copied from the live tier now."""
        keys, values = self.blocks()
        return replace(self, live=None, keys=keys, values=values)

    def blocks(self) -> tuple[list[int], list[BlockStored]]:
        if self.keys is not None and self.values is not None:
            return self.keys, self.values
        assert self.live is not None and len(self.live) == self.length, "not the state planned"
        return _copy_from(self.live, self.start)


def tails(state: CacheState, previous: Mapping[TierId, TierCut], present: Container[str],
          copy: bool = True) -> list[TierTail]:
    """What an export of ``state`` now must cut, tier by tier, given the previous export's
    cuts: the blocks to cut copied now (``copy``), or left to be read from the live tiers by a
    forked child; no await may come between this and the export's instant. Reused pieces must
    be in ``present`` (Redis holds them), else that tier is cut whole."""
    out = list[TierTail]()
    for source, medium, group, tier in state.tiers():
        tid = (source, medium, group)
        edits = state.edits(source, medium, group)
        prev = previous.get(tid)
        start, kept = 0, tuple[Piece, ...]()
        if prev is not None and prev.pieces and prev.edits == edits and len(tier) >= prev.length:
            kept = prev.pieces[:-1]
            if all(p.address in present for p in kept):
                start = kept[-1].end if kept else 0
            else:
                kept = ()
        part = TierTail(tid, edits, kept, start, len(tier), tier)
        out.append(part.copied() if copy else part)
    return out


def _copy_from(tier: Tier, start: int) -> tuple[list[int], list[BlockStored]]:
    """The tier's keys and values from position ``start`` on, read from its end."""
    if start == 0:
        return list(tier), list(tier.values())
    n = len(tier) - start
    keys = list(islice(reversed(tier), n))
    values = list(islice(reversed(tier.values()), n))
    keys.reverse()
    values.reverse()
    return keys, values


def cut_tails(parts: list[TierTail], cuts: Cuts, known: Mapping[bytes, tuple[str, int]],
              present: Container[str]) -> Iterator[Piece]:
    """The export's pieces in order (events.checkpoint_cut.pieces's, for the state ``parts``
    were taken of): each tier's kept pieces, then its tail cut."""
    for part in parts:
        yield from part.kept
        source, medium, group = part.tier
        keys, values = part.blocks()
        yield from cut_tail(source, medium, group, part.start, keys, values, cuts, known, present)


class CutBook:
    """The previous export's cuts, per tier, as a checkpoint writer keeps them: fed each
    piece of an export in order, and made current only once that export is complete."""

    def __init__(self) -> None:
        self.cuts: dict[TierId, TierCut] = {}
        self._next: dict[TierId, list[Piece]] = {}
        self._edits: dict[TierId, int] = {}
        self._order: list[tuple[TierId, int]] = []  # (tier, its length) of the export begun
        self._at = 0

    def known(self, present: Container[str]) -> dict[bytes, tuple[str, int]]:
        """fingerprint -> (address, length) of every piece of the previous export that Redis
        holds: what a tier cut whole reuses."""
        return {p.fingerprint: (p.address, p.length) for c in self.cuts.values()
                for p in c.pieces if p.address in present}

    def begin(self, parts: list[TierTail]) -> None:
        self._next = {p.tier: [] for p in parts}
        self._edits = {p.tier: p.edits for p in parts}
        self._order = [(p.tier, p.length) for p in parts]
        self._at = 0

    def add(self, piece: Piece) -> None:
        """The export's next piece; ValueError when it does not fit the tiers' lengths."""
        while self._at < len(self._order) and self._filled(self._at):
            self._at += 1
        if self._at == len(self._order):
            raise ValueError("an export piece beyond the last tier")
        tid, length = self._order[self._at]
        got = self._next[tid]
        if piece.end > length or (got and piece.end <= got[-1].end) or piece.end <= 0:
            raise ValueError(f"export piece ending at {piece.end} does not fit tier {tid} "
                             f"of {length} blocks")
        got.append(Piece(piece.address, piece.length, piece.fingerprint, None, piece.end))

    def _filled(self, at: int) -> bool:
        tid, length = self._order[at]
        got = self._next[tid]
        return length == 0 or (bool(got) and got[-1].end == length)

    def check(self) -> None:
        """ValueError unless the export's pieces reached every tier's end."""
        if not all(self._filled(i) for i in range(len(self._order))):
            raise ValueError("export ended before its last tier's end")

    def commit(self) -> None:
        """The export was complete and written: its cuts are the previous export's now."""
        self.check()
        self.cuts = {t: TierCut(self._edits[t], tuple(ps)) for t, ps in self._next.items()}
        self._next, self._order = {}, []
