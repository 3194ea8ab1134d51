"""A checkpoint that cuts only what changed since the previous one (issue 17, checkpoint cost).

events.checkpoint_cut cuts each tier of CacheState into content-defined segments in insertion
order; a boundary depends only on the blocks since the previous boundary. So when a tier only
grew since the previous export (no change recorded but appends: ``CacheState.edits``
unchanged), every segment of that export but its last is a segment of the tier now, at the
same positions, with the same blocks and the same events: its chunk is reused as it was,
without a look at its blocks. Only the blocks from the previous last segment's start to the
tier's end are cut again. When blocks were removed or stored again (a GPU tier evicting, in
steady state), the writer's :class:`CutBook` knows which segment each hash of the previous cut
is in, and events.checkpoint_dirty keeps every segment those changes did not touch and cuts
the rest (DECISIONS 68). A tier cleared or replaced, or one whose changes the book cannot
place, is cut whole, as before (the fingerprints of the previous export still spare
re-encoding its unchanged segments). The work of a checkpoint is then what changed, not the
resident state.

The blocks cut again are copied at the checkpoint's instant (C speed, skipping what is kept),
so the copy may be cut later, while the state moves on: in the daemon's loop in slices, or in a
forked child.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping
from dataclasses import dataclass, replace
from itertools import repeat

from events.checkpoint_cut import Cuts, Piece, cut_tail
from events.checkpoint_dirty import Stretch, copy_from, plan
from events.schema import BlockStored, Medium
from events.state import CacheState
from events.state_apply import TierChanges
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
    by whoever holds the state of that instant (a forked child). ``whole``: no piece of the
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
          copy: bool = True, book: CutBook | None = None, cuts: Cuts | None = None,
          limit: int | None = None) -> list[TierTail]:
    """What an export of ``state`` now must cut, tier by tier, given the previous export's
    cuts: the blocks to cut copied now (``copy``), or, where a tier's last stretch is all,
    left to be read from the live tier by a forked child; no await may come between this and
    the export's instant. Reused pieces must be in ``present`` (Redis holds them). With
    ``book`` (the writer's CutBook, opened on the state's changes) a tier with removals keeps
    its untouched segments (cut by ``cuts``, the export's), unless more than ``limit`` blocks of
    it would be cut."""
    out = list[TierTail]()
    for source, medium, group, tier in state.tiers():
        tid = (source, medium, group)
        edits = state.edits(source, medium, group)
        prev = previous.get(tid)
        n = len(tier)
        stretches: list[Stretch] | None = None
        if prev is not None and prev.pieces:
            changes = book.changes.get(tid) if book is not None else None
            if changes is None and prev.edits == edits and n >= prev.length:
                stretches = _appended(prev, present, n)
            elif changes is not None and not changes.reset and book is not None and tid in book.maps:
                stretches = plan(tier, prev.pieces, book.maps[tid], changes.removed,
                                 changes.rewritten, present, cuts or Cuts(), limit)
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


class CutBook:
    """The previous export's cuts, per tier, as a checkpoint writer keeps them: fed each
    piece of an export in order, and made current only once that export is complete. Per
    tier it also maps each hash of that cut to its piece's fingerprint (``maps``), and holds
    the reducer's changes since that cut (``changes``): what lets a tier with removals keep
    its untouched segments (events.checkpoint_dirty). A map is built while an export's
    pieces arrive; an export that never completes drops the maps it touched (those tiers are
    cut whole once they change again)."""

    def __init__(self, max_changes: int = 1 << 22) -> None:
        self.cuts: dict[TierId, TierCut] = {}
        self.maps: dict[TierId, dict[int, bytes]] = {}
        self.changes: dict[TierId, TierChanges] = {}
        self.max_changes = max_changes  # hashes held per tier; beyond, the tier is cut whole
        self._taken: dict[TierId, TierChanges] = {}
        self._next: dict[TierId, list[Piece]] = {}
        self._edits: dict[TierId, int] = {}
        self._building: dict[TierId, dict[int, bytes]] = {}
        self._order: list[tuple[TierId, int]] = []  # (tier, its length) of the export begun
        self._at = 0

    def open(self, changes: Mapping[TierId, TierChanges]) -> None:
        """Start an export: the reducer's changes since the last call (CacheState.take_changes)
        join those not yet covered by a complete export. An export begun and never committed
        is given up here: its tiers' maps are dropped and its changes kept."""
        if self._order:
            for tid, _ in self._order:
                self.maps.pop(tid, None)
            self._merge(self._taken)
            self._order, self._next, self._building = [], {}, {}
        self._taken = {}
        self._merge(changes)

    def _merge(self, changes: Mapping[TierId, TierChanges]) -> None:
        for tid, new in changes.items():
            have = self.changes.get(tid)
            if have is None:
                self.changes[tid] = have = TierChanges()
            if new.reset or have.reset or len(have.removed) + len(new.removed) > self.max_changes:
                have.mark_reset()
            else:
                have.removed.extend(new.removed)
                have.rewritten.extend(new.rewritten)

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
        self._taken, self.changes = self.changes, {}
        self._building = {}
        for p in parts:
            seg_of = self.maps.get(p.tier)
            if p.whole:
                self._building[p.tier] = {}  # built anew as the pieces arrive
            elif seg_of is not None:  # kept pieces' hashes stay; the rest come with their piece
                taken = self._taken.get(p.tier)
                for h in taken.removed if taken is not None else ():
                    seg_of.pop(h, None)
                self._building[p.tier] = seg_of
            # else: kept pieces whose hashes no map holds: none until the tier is cut whole

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
        seg_of = self._building.get(tid)
        if seg_of is not None and piece.keys is not None:
            seg_of.update(zip(piece.keys, repeat(piece.fingerprint)))

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
        self.maps = self._building
        self._next, self._order, self._building, self._taken = {}, [], {}, {}
