"""A checkpoint that cuts only what changed (events.checkpoint_delta, events.checkpoint_dirty):
after any mix of changes its chunks are exactly those of a full cut of the same state, a tier
that only grew is cut from its previous last segment on, not from its start, and a tier with
removals keeps the segments they did not touch."""

from __future__ import annotations

import random

from events.checkpoint import Manifest, decode_snapshot
from events.checkpoint_book import CutBook
from events.checkpoint_cut import Piece, fences, pieces
from events.checkpoint_delta import cut_tails
from events.schema import AllBlocksCleared, BlockRemoved
from events.state import CacheState
from tests.events.test_checkpoint_cut import CUTS, Log, stored


class Delta:
    """What the daemon's Checkpointer does around the delta cut: the book of the previous cut,
    the addresses Redis holds (here: a dict)."""

    def __init__(self, state: CacheState, removals: bool = True) -> None:
        self.state = state
        self.removals = removals  # False: the book knows no removals (a tier with any cut whole)
        state.track_changes()
        self.book = CutBook()
        self.store: dict[str, bytes] = {}
        self.cut = 0  # blocks the last export cut

    def export(self, stop_after: int | None = None, limit: int | None = None) -> list[Piece]:
        """One export; ``stop_after`` pieces: one that fails there (never committed); ``limit``:
        blocks a tier with removals may cut before it is cut whole."""
        changes = self.state.take_changes()
        for change in changes.values() if not self.removals else ():
            change.mark_reset()
        for _ in self.book.absorb(changes, step=5):  # in steps, as the daemon's loop takes them
            pass
        parts = self.book.plan(self.state, self.store, cuts=CUTS, limit=limit)
        self.cut = sum(p.todo for p in parts)
        self.book.begin(parts)
        got: list[Piece] = []
        for piece in cut_tails(parts, CUTS, self.book.known(self.store), self.store):
            if len(got) == stop_after:
                return got
            self.book.add(piece)
            got.append(piece)
            if piece.data is not None:
                self.store[piece.address] = piece.data
        self.book.commit()
        return got

    def check(self) -> list[Piece]:
        """Export; assert it is the full cut of the state now and loads back to the state."""
        got = self.export()
        full = list(pieces(self.state.tiers(), CUTS, {}, set()))
        assert [p.address for p in got] == [p.address for p in full]
        assert [p.end for p in got] == [p.end for p in full]
        manifest = Manifest("x", self.state.offset, "e", 0.0, (0,), 0, 2,
                            tuple(p.address for p in got), fences(self.state))
        back = CacheState.from_snapshot(decode_snapshot(manifest, [self.store[p.address] for p in got]))
        assert back == self.state
        return got


def grow(log: Log, source: str, first: int, n: int, medium: str = "GPU", group: int = 0) -> None:
    for h in range(first, first + n):
        log.put(source, stored([h], medium, tok=h, group=group))


def test_appends_cut_only_the_last_segment_on() -> None:
    log = Log()
    grow(log, "a", 1, 500)
    grow(log, "a", 10_000, 300, "CPU")
    d = Delta(log.state)
    d.check()
    assert d.cut == 800
    edits = log.state.edits("a", "GPU")
    grow(log, "a", 501, 20)  # only the GPU tier grew
    d.check()
    assert log.state.edits("a", "GPU") == edits  # appends do not count
    assert 20 < d.cut <= 20 + CUTS.max  # the previous last GPU segment and what follows it
    d.check()
    assert d.cut <= 2 * CUTS.max  # nothing new: each tier's last segment only


def test_every_kind_of_change_stays_exact() -> None:
    log = Log()
    grow(log, "a", 1, 400)
    grow(log, "b", 1, 100)
    d = Delta(log.state)
    d.check()
    steps = [
        ("a removal in the middle", lambda: log.put("a", BlockRemoved((200,), "GPU"))),
        ("a hash stored again", lambda: log.put("a", stored([100], tok=7))),
        ("a removal of the last block", lambda: log.put("a", BlockRemoved((400,), "GPU"))),
        ("a new tier", lambda: grow(log, "a", 5000, 50, "CPU")),
        ("a new group", lambda: grow(log, "a", 7000, 50, group=1)),
        ("a tier emptied", lambda: log.put("b", BlockRemoved(tuple(range(1, 101)), "GPU"))),
        ("the emptied tier grows", lambda: grow(log, "b", 200, 30)),
        ("AllBlocksCleared of one medium", lambda: log.put("a", AllBlocksCleared("CPU"))),
        ("the cleared tier again", lambda: grow(log, "a", 5000, 10, "CPU")),
        ("a new incarnation", lambda: log.put("b", stored([1]), inc=2)),
    ]
    for what, change in steps:
        before = {(s, m, g): log.state.edits(s, m, g) for s, m, g, _ in log.state.tiers()}
        change()
        changed = [t for t, n in before.items() if log.state.edits(*t) != n]
        d.check()
        if what not in ("a new tier", "a new group", "the emptied tier grows", "the cleared tier again"):
            assert changed, what  # the count moved
        grow(log, "a", 20_000 + 100 * steps.index((what, change)), 5)  # then appends again
        d.check()


def test_a_restore_counts_as_a_change_of_every_tier() -> None:
    log = Log()
    grow(log, "a", 1, 200)
    d = Delta(log.state)
    d.check()
    other = Log()
    grow(other, "a", 1, 150)  # a prefix of the same tier: only a count can tell it apart
    grow(other, "a", 900, 80)
    edits = log.state.edits("a", "GPU")
    log.state.restore(other.state.export())
    assert log.state.edits("a", "GPU") != edits
    d.check()
    assert d.cut == 230


def test_a_lost_chunk_of_the_kept_pieces_cuts_its_tier_whole() -> None:
    log = Log()
    grow(log, "a", 1, 300)
    d = Delta(log.state)
    first = d.check()
    del d.store[first[0].address]  # Redis lost it: the kept pieces are not all there
    grow(log, "a", 301, 5)
    got = d.check()
    assert d.cut == 305 and got[0].data is not None


def test_random_changes_stay_exact() -> None:
    rng = random.Random(7)
    log = Log()
    d = Delta(log.state)
    resident: dict[tuple[str, str], list[int]] = {}
    next_hash, partial = 1, 0
    for _ in range(60):
        for _ in range(rng.randint(1, 4)):
            source, medium = rng.choice(["a", "b"]), rng.choice(["GPU", "CPU"])
            have = resident.setdefault((source, medium), [])
            kind = rng.random()
            if kind < 0.6 or not have:
                n = rng.randint(1, 40)
                log.put(source, stored(range(next_hash, next_hash + n), medium, tok=next_hash))
                have.extend(range(next_hash, next_hash + n))
                next_hash += n
            elif kind < 0.85:
                gone = rng.sample(have, min(len(have), rng.randint(1, 5)))
                log.put(source, BlockRemoved(tuple(gone), medium))  # type: ignore[arg-type]
                have[:] = [h for h in have if h not in gone]
            elif kind < 0.95:
                again = rng.choice(have)
                log.put(source, stored([again], medium, tok=rng.randint(1, 99)))
            else:
                log.put(source, AllBlocksCleared(medium))  # type: ignore[arg-type]
                have.clear()
        d.check()
        partial += d.cut < sum(log.state.counts().values())
    assert partial > 10  # many of them cut only a part


def test_removals_at_the_front_keep_the_segments_behind_them() -> None:
    """An LRU tier in steady state: the oldest blocks go as new ones come."""
    log = Log()
    grow(log, "a", 1, 2000)
    d, whole = Delta(log.state), Delta(log.state, removals=False)
    d.check()
    whole.export()
    for step in range(5):
        log.put("a", BlockRemoved(tuple(range(1 + 40 * step, 41 + 40 * step)), "GPU"))
        grow(log, "a", 10_000 + 40 * step, 40)
        d.check()
        whole.export()
        assert whole.cut == 2000  # before: the tier cut whole
        assert d.cut <= 40 + 3 * CUTS.max  # now: around the removals and the tail
    assert d.book.maps[("a", "GPU", 0)].keys() == set(log.state.resident("a", "GPU"))


def test_a_removal_in_the_middle_and_a_hash_stored_again_cut_their_segments_only() -> None:
    log = Log()
    grow(log, "a", 1, 3000)
    d = Delta(log.state)
    d.check()
    log.put("a", BlockRemoved((1500,), "GPU"))
    d.check()
    assert d.cut <= 3 * CUTS.max
    log.put("a", stored([700], tok=5))  # in place, other tokens
    d.check()
    assert d.cut <= 3 * CUTS.max
    log.put("a", BlockRemoved(tuple(range(1000, 1200)), "GPU"))  # whole segments gone
    grow(log, "a", 1000, 10)  # and some of them back, at the end
    d.check()
    assert d.cut <= 200 + 4 * CUTS.max


def test_an_export_never_committed_leaves_the_next_exact() -> None:
    log = Log()
    grow(log, "a", 1, 600)
    d = Delta(log.state)
    d.check()
    log.put("a", BlockRemoved((10, 20, 300), "GPU"))
    grow(log, "a", 700, 20)
    d.export(stop_after=1)  # Redis went away midway: no commit
    log.put("a", BlockRemoved((400,), "GPU"))
    d.check()  # its map dropped: cut whole, exact
    assert d.cut == len(log.state.resident("a", "GPU"))
    log.put("a", BlockRemoved((500,), "GPU"))
    d.check()  # the map built again by that whole cut
    assert d.cut < 100


def test_random_removals_and_appends_stay_exact_and_mostly_partial() -> None:
    rng = random.Random(11)
    log = Log()
    grow(log, "a", 1, 1500)
    d = Delta(log.state)
    d.check()
    have, next_hash, partial = list(range(1, 1501)), 5000, 0
    for _ in range(40):
        if rng.random() < 0.5:  # the oldest go (LRU)
            k = rng.randint(1, 30)
            gone, have = have[:k], have[k:]
        else:  # anywhere
            gone = rng.sample(have, rng.randint(1, 4))
            have = [h for h in have if h not in gone]
        log.put("a", BlockRemoved(tuple(gone), "GPU"))
        n = rng.randint(0, 30)
        grow(log, "a", next_hash, n)
        have.extend(range(next_hash, next_hash + n))
        next_hash += n
        if rng.random() < 0.2:
            log.put("a", stored([rng.choice(have)], tok=rng.randint(1, 99)))
        d.check()
        partial += d.cut < len(have) // 2
    assert partial > 30


def test_removals_touching_more_than_the_limit_cut_the_tier_whole() -> None:
    log = Log()
    grow(log, "a", 1, 1000)
    d = Delta(log.state)
    d.check()
    log.put("a", BlockRemoved(tuple(range(1, 1000, 50)), "GPU"))  # a hole in every segment
    d.export(limit=100)
    assert d.cut == 980
    log.put("a", BlockRemoved((2,), "GPU"))
    d.export(limit=100)  # mapped anew by that whole cut
    assert d.cut < 100
    d.check()


def test_a_lost_chunk_beside_removals_is_cut_again_alone() -> None:
    log = Log()
    grow(log, "a", 1, 1000)
    d = Delta(log.state)
    first = d.check()
    del d.store[first[len(first) // 2].address]  # Redis lost a chunk in the middle
    log.put("a", BlockRemoved((3,), "GPU"))
    got = d.check()
    assert d.cut < 4 * CUTS.max  # that segment, the one with the hole, the tail
    assert first[len(first) // 2].address in {p.address for p in got if p.data is not None}


def test_an_export_never_committed_costs_no_whole_cut_until_its_tiers_change_again() -> None:
    """A failed export drops the maps its pieces may have changed, nothing more: the next
    export still plans from the previous cut (around the holes already placed, appends as
    appends), and a tier whose map went is cut whole once it has a removal again."""
    log = Log()
    grow(log, "a", 1, 2000)
    grow(log, "b", 1, 2000)
    d = Delta(log.state)
    d.check()
    log.put("a", BlockRemoved((10, 1500), "GPU"))
    grow(log, "b", 5000, 20)
    d.export(stop_after=3)  # Redis went away midway: no commit
    d.check()
    assert d.cut <= 20 + 6 * CUTS.max  # not 4,000: a around its holes and end, b its end
    log.put("a", BlockRemoved((700,), "GPU"))
    grow(log, "b", 6000, 5)
    d.check()
    assert d.cut >= len(log.state.resident("a", "GPU"))  # a's map went with that export
    assert d.cut <= len(log.state.resident("a", "GPU")) + 5 + 2 * CUTS.max  # b: its end only
    log.put("a", BlockRemoved((800,), "GPU"))
    d.check()
    assert d.cut <= 3 * CUTS.max  # mapped again by that whole cut


def test_a_tier_that_only_grows_keeps_no_map_and_its_first_change_cuts_it_whole_once() -> None:
    """A map of hash -> segment is kept only for a tier that changes otherwise than by
    appends (DECISIONS 74): the first export maps every tier, the next drops the map of one that
    only grew; that tier's first removal cuts it whole once (exact), which maps it again, and
    from then on its removals cut only their segments."""
    log = Log()
    grow(log, "a", 1, 1000)
    grow(log, "b", 1, 1000)
    d = Delta(log.state)
    d.check()
    assert set(d.book.maps) == {("a", "GPU", 0), ("b", "GPU", 0)}  # the first export: all
    grow(log, "a", 5000, 300)
    log.put("b", BlockRemoved((10,), "GPU"))
    grow(log, "b", 5000, 300)
    d.check()
    assert set(d.book.maps) == {("b", "GPU", 0)}  # "a" only grew: its map went
    assert d.cut <= 300 + 2 * CUTS.max + 300 + 3 * CUTS.max
    for round_ in range(3):  # still growing: appends cut alone, no map comes back
        grow(log, "a", 6000 + 100 * round_, 100)
        d.check()
        assert ("a", "GPU", 0) not in d.book.maps and d.cut <= 100 + 2 * CUTS.max
    log.put("a", BlockRemoved((500,), "GPU"))  # its first change: cut whole, mapped again
    d.check()
    whole_a = len(log.state.resident("a", "GPU"))
    assert whole_a <= d.cut <= whole_a + CUTS.max  # all of "a", and "b"'s last segment
    assert d.book.maps[("a", "GPU", 0)].keys() == set(log.state.resident("a", "GPU"))
    log.put("a", BlockRemoved((700,), "GPU"))  # from then on: its segments only
    d.check()
    assert d.cut <= 3 * CUTS.max + 2 * CUTS.max
