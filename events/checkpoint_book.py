"""What a checkpoint writer keeps of its previous export, so that the next cuts only what changed
(events.checkpoint_delta; DECISIONS 65, 68).

Per tier: the previous export's pieces (their fingerprints and where each ended), a map of
each hash of that export to its piece's fingerprint, and the segments the reducer's changes
touched since (``touched``: per fingerprint the blocks the segment lost; None where the tier
must be cut whole: cleared, replaced, or no map). A map is kept only for a tier that changes
otherwise than by appends (``changing``: one that has since this book's first export; the
first export maps every tier, which of them will change is not known yet): an append-only tier
(a cache still filling, a benchmark's stream) never needs one, and a map grows with its tier,
~0.1 us a block appended and, at each doubling, a resize that stalls the loop for tens of ms at
a million entries (DECISIONS 74). Its first change then costs one cut of it whole, which maps it
from then on. The reducer's changes
(CacheState.take_changes) are placed on segments as they are taken (:meth:`CutBook.absorb`, in
steps a caller can yield between), so the export's instant finds them counted. A map is built
while an export's pieces arrive (each piece carries its hashes); an export that never
completes drops the maps its pieces were added to, and those tiers are cut whole once they
change again (the previous cuts and the changes placed on them stay current).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Iterator, Mapping
from itertools import islice, repeat

from events.checkpoint_cut import Cuts, Piece
from events.checkpoint_delta import TierCut, TierId, TierTail, tails
from events.checkpoint_dirty import Touched
from events.state import CacheState
from events.state_changes import TierChanges


class CutBook:
    """The previous export's cuts, per tier (module docstring): fed each piece of an export in
    order, and made current only once that export is complete."""

    def __init__(self, mapping: bool = True) -> None:
        self.mapping = mapping  # False: no maps (a tier with removals is always cut whole)
        self.cuts: dict[TierId, TierCut] = {}
        self.maps: dict[TierId, dict[int, bytes]] = {}  # hash -> its piece's fingerprint
        self.touched: dict[TierId, Touched | None] = {}  # since the cuts' export
        self._next: dict[TierId, list[Piece]] = {}
        self._edits: dict[TierId, int] = {}
        self._building: dict[TierId, dict[int, bytes]] = {}
        self._order: list[tuple[TierId, int]] = []  # (tier, its length) of the export begun
        self._at = 0
        self.changing: set[TierId] = set()  # tiers changed otherwise than by appends: mapped
        self._is_first = True  # no export committed yet: every tier cut whole is mapped

    def absorb(self, changes: Mapping[TierId, TierChanges], step: int = 1 << 30) -> Iterator[None]:
        """Place the reducer's changes (CacheState.take_changes) on the previous cut's
        segments, yielding after each ``step`` hashes (the caller may let its loop run there;
        no export may begin meanwhile). A removed hash leaves its map: the export that cuts
        its segment again maps what is still resident anew."""
        self._give_up()
        for tid, change in changes.items():
            self.changing.add(tid)
            seg_of = self.maps.get(tid)
            counts = self.touched.get(tid, Counter())
            if change.reset or seg_of is None or counts is None or not self.mapping or tid not in self.cuts:
                self.touched[tid] = None
                self.maps.pop(tid, None)
                continue
            self.touched[tid] = counts
            pop: Callable[[int, None], bytes | None] = seg_of.pop
            get: Callable[[int], bytes | None] = seg_of.get
            removed = change.removed
            for at in range(0, len(removed), step):
                # In C: a hash removed twice (removed, stored again, removed) pops once; None
                # (filtered): appended since that cut, or never resident.
                counts.update(filter(None, map(pop, islice(removed, at, at + step), repeat(None))))
                yield
            counts.update(dict.fromkeys(filter(None, map(get, change.rewritten)), 0))

    def note(self, changes: Mapping[TierId, TierChanges]) -> None:
        """:meth:`absorb` at once."""
        for _ in self.absorb(changes):
            pass

    def _give_up(self) -> None:
        """An export begun and never committed: the maps its pieces were added to (those kept
        from the previous cut: :meth:`begin`) are dropped. The previous cuts stay current and
        so do the changes placed on them (``touched``), so the next export plans from them as
        before; a tier whose map went is cut whole once a change of it comes (:meth:`absorb`)."""
        for tid, _ in self._order:
            building = self._building.get(tid)
            if building is not None and building is self.maps.get(tid):
                del self.maps[tid]
        self._order, self._next, self._building = [], {}, {}

    @property
    def begun(self) -> bool:
        """An export has begun (:meth:`begin`: its instant has passed) and is neither
        committed nor given up yet."""
        return bool(self._order)

    def known(self, present: Container[str]) -> dict[bytes, tuple[str, int]]:
        """fingerprint -> (address, length) of every piece of the previous export that Redis
        holds: what a tier cut whole reuses."""
        return {p.fingerprint: (p.address, p.length) for c in self.cuts.values()
                for p in c.pieces if p.address in present}

    def plan(self, state: CacheState, present: Container[str], copy: bool = True,
             cuts: Cuts | None = None, limit: int | None = None) -> list[TierTail]:
        """events.checkpoint_delta.tails of ``state`` now against this book (its changes
        absorbed first); then :meth:`begin` with them."""
        self._give_up()
        return tails(state, self.cuts, present, copy, self.touched, cuts, limit)

    def begin(self, parts: list[TierTail]) -> None:
        self._next = {p.tier: [] for p in parts}
        self._edits = {p.tier: p.edits for p in parts}
        self._order = [(p.tier, p.length) for p in parts]
        self._at = 0
        for p in parts:
            seg_of = self.maps.get(p.tier)
            if not (self._is_first or p.tier in self.changing):
                continue  # append-only so far: no map (one there since the first export goes)
            if p.whole and self.mapping:
                self._building[p.tier] = {}  # built anew as the pieces arrive
            elif seg_of is not None:  # kept pieces' hashes stay; removed ones left in absorb
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
        self.touched = {}  # changes are placed on these cuts from here on
        self._is_first = False
        self._next, self._order, self._building = {}, [], {}
