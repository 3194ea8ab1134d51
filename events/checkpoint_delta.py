"""A checkpoint that cuts only what changed since the previous one (issue 17, checkpoint cost).

events.checkpoint_cut cuts each tier of CacheState into content-defined segments in insertion
order; a boundary depends only on the blocks since the previous boundary. So when a tier only
grew since the previous export (no change recorded but appends: ``CacheState.edits``
unchanged), every segment of that export but its last is a segment of the tier now, at the
same positions, with the same blocks and the same events: its chunk is reused as it was,
without a look at its blocks. Only the blocks from the previous last segment's start to the
tier's end are cut again. When blocks were removed or stored again (a GPU tier evicting, in
steady state), the writer's events.checkpoint_book.CutBook knows which segment each hash of
the previous cut is in, and events.checkpoint_dirty keeps every segment those changes did not touch and cuts
the rest (DECISIONS 68). A tier cleared or replaced, or one whose changes the book cannot
place, is cut whole, as before (the fingerprints of the previous export still spare
re-encoding its unchanged segments). The work of a checkpoint is then what changed, not the
resident state.

The blocks cut again are copied at the checkpoint's instant (C speed, skipping what is kept),
so the copy may be cut later, while the state moves on: in the daemon's loop in slices, or in a
forked child. A tier's last stretch, its tail, may instead be read after the instant while the
tier's changes since leave it where it was (offloadd.log.later_read).
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping
from dataclasses import dataclass, replace

from events.checkpoint_cut import Cuts, Piece, cut_tail
from events.checkpoint_dirty import Stretch, Touched, copy_from, plan
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
    """One tier's part of an export: its stretches in order (events.checkpoint_dirty.Stretch:
    pieces kept as they were, then blocks to cut), ``length`` the tier's length at the
    export's instant. The last stretch's blocks may be left uncopied, to be read from ``live``
    by whoever holds the state of that instant (a forked child) or can tell that the live tier
    still holds them where they were (offloadd.log.later_read). ``whole``: no piece of the
    previous export is kept (the tier is cut from its start)."""

    tier: TierId
    edits: int
    stretches: tuple[Stretch, ...]
    length: int
    live: Tier | None = None

    @property
    def todo(self) -> int:
        """Blocks to cut."""
        return sum(s.end - s.start for s in self.stretches)

    @property
    def whole(self) -> bool:
        return all(not s.kept for s in self.stretches) and self.stretches[0].start == 0

    def copied(self) -> TierTail:
        """This part with its blocks copied from the live tier now."""
        return replace(self, live=None, stretches=tuple(map(self._copied, self.stretches)))

    def blocks(self, stretch: Stretch) -> tuple[list[int], list[BlockStored]]:
        if stretch.keys is not None and stretch.values is not None:
            return stretch.keys, stretch.values
        assert self.live is not None and len(self.live) == self.length, "not the state planned"
        return copy_from(self.live, stretch.start)

    def _copied(self, stretch: Stretch) -> Stretch:
        if stretch.keys is not None:
            return stretch
        keys, values = self.blocks(stretch)
        return replace(stretch, keys=keys, values=values)


def tails(state: CacheState, previous: Mapping[TierId, TierCut], present: Container[str],
          copy: bool = True, touched: Mapping[TierId, Touched | None] | None = None,
          cuts: Cuts | None = None, limit: int | None = None) -> list[TierTail]:
    """What an export of ``state`` now must cut, tier by tier, given the previous export's
    cuts: the blocks to cut copied now (``copy``), or each tier's last stretch left to be read
    from the live tier (TierTail); no await may come between this and the export's instant.
    Reused pieces must be in ``present`` (Redis holds them). With ``touched``
    (events.checkpoint_book.CutBook's: per tier changed otherwise than by appends, the segments
    those changes touched, None where it cannot say) such a tier keeps its untouched segments
    (cut by ``cuts``, the export's), unless more than ``limit`` blocks of it would be cut."""
    out = list[TierTail]()
    for source, medium, group, tier in state.tiers():
        tid = (source, medium, group)
        edits = state.edits(source, medium, group)
        prev = previous.get(tid)
        n = len(tier)
        stretches: list[Stretch] | None = None
        if prev is not None and prev.pieces:
            if touched is None or tid not in touched:
                if prev.edits == edits and n >= prev.length:
                    stretches = _appended(prev, present, n)
            elif (segments := touched[tid]) is not None:
                stretches = plan(tier, prev.pieces, segments, present, cuts or Cuts(), limit)
        part = TierTail(tid, edits, tuple(stretches or (Stretch((), 0, n),)), n, tier)
        out.append(part.copied() if copy else part)
    return out


def _appended(prev: TierCut, present: Container[str], n: int) -> list[Stretch] | None:
    """A tier with blocks appended only: every previous piece but the last kept."""
    kept = prev.pieces[:-1]
    if not all(p.address in present for p in kept):
        return None
    return [Stretch(kept, kept[-1].end if kept else 0, n)]


def cut_tails(parts: list[TierTail], cuts: Cuts, known: Mapping[bytes, tuple[str, int]],
              present: Container[str]) -> Iterator[Piece]:
    """The export's pieces in order (events.checkpoint_cut.pieces's, for the state ``parts``
    were taken of): per tier, each stretch's kept pieces, then its blocks cut."""
    for part in parts:
        source, medium, group = part.tier
        for stretch in part.stretches:
            yield from stretch.kept
            keys, values = part.blocks(stretch)
            yield from cut_tail(source, medium, group, stretch.start, keys, values, cuts, known,
                                present)
