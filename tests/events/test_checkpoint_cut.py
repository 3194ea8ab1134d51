"""Format 2 checkpoint chunks (events.checkpoint_cut): cut by content, so an export after a
change re-encodes only the segments the change touched, and what it reuses is exactly what the
state holds."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from events.checkpoint import CheckpointBroken, Manifest, chunk_keys, decode_snapshot
from events.checkpoint_cut import (
    Cuts,
    Piece,
    cut_tail,
    encode_segment,
    fences,
    fingerprint,
    pieces,
    segments,
)
from events.logkeys import LogKeys
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, Event, LogRecord
from events.state import CacheState

CUTS = Cuts(4, 8, 32)


class Log:
    def __init__(self) -> None:
        self.state = CacheState()
        self.seq: dict[str, int] = {}

    def put(self, source: str, *events: Event, inc: int = 1) -> None:
        seq = self.seq[source] = self.seq.get(source, 0) + 1
        self.state.apply(LogRecord(self.state.offset + 1, source, inc, seq, 0.0, events))


def stored(hashes: Sequence[int], medium: str = "GPU", parent: int | None = None, tok: int = 1,
           group: int = 0) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(range(tok, tok + 2 * len(hashes))), 2,
                       medium, group)  # type: ignore[arg-type]


class Exporter:
    """What the daemon's Checkpointer does around ``pieces``: known fingerprints, the
    addresses Redis holds (here: a dict)."""

    def __init__(self, state: CacheState) -> None:
        self.state = state
        self.known: dict[bytes, tuple[str, int]] = {}
        self.store: dict[str, bytes] = {}

    def export(self) -> tuple[list[Piece], Manifest]:
        got = list(pieces(self.state.tiers(), CUTS, self.known, self.store))
        for p in got:
            if p.data is not None:
                self.store[p.address] = p.data
        self.known = {p.fingerprint: (p.address, p.length) for p in got}
        manifest = Manifest("x", self.state.offset, "e", 0.0, (0,), 0, 2,
                            tuple(p.address for p in got), fences(self.state))
        return got, manifest

    def load(self, manifest: Manifest) -> CacheState:
        return CacheState.from_snapshot(decode_snapshot(manifest, [self.store[a] for a in manifest.chunks]))


def new(got: list[Piece]) -> int:
    return sum(p.data is not None for p in got)


def test_a_mixed_state_comes_back_whole() -> None:
    log = Log()
    for i in range(40):  # chains of 5 single-block events, and multi-block events
        log.put("a", stored([1000 + i], parent=None if i % 5 == 0 else 999 + i))
        log.put("a", stored([5000 + 3 * i, 5001 + 3 * i, 5002 + 3 * i], "CPU", tok=i))
    log.put("a", stored([77, 78], group=1))
    log.put("b", stored([1, 2, 3]), inc=0)  # unfenced
    log.put("c", stored([9]))
    log.put("c", AllBlocksCleared())  # fenced, no blocks
    ex = Exporter(log.state)
    got, manifest = ex.export()
    assert len(got) > 5 and new(got) == len(got)
    back = ex.load(manifest)
    assert back == log.state and back.sources() == ["a", "b", "c"] and back.fence("b") is None
    assert back.blocks("a", "GPU")[1003].parent == 1002  # chains keep each block's parent


def test_appends_change_only_the_last_segment_and_add_new_ones() -> None:
    log = Log()
    for i in range(400):
        log.put("a", stored([i * 7 + 1]))
    ex = Exporter(log.state)
    first, _ = ex.export()
    for i in range(400, 440):
        log.put("a", stored([i * 7 + 1]))
    second, manifest = ex.export()
    old = {p.address for p in first}
    assert [p.address in old for p in second[: len(first) - 1]] == [True] * (len(first) - 1)
    assert all(p.data is not None for p in second if p.address not in old)
    assert new(second) <= 1 + 40 // CUTS.min + 1
    assert ex.load(manifest) == log.state


def test_a_removal_changes_only_its_own_segment() -> None:
    log = Log()
    for i in range(1000):
        log.put("a", stored([i * 13 + 5], "CPU"))
    ex = Exporter(log.state)
    first, _ = ex.export()
    log.put("a", BlockRemoved((500 * 13 + 5,), "CPU"))
    second, manifest = ex.export()
    assert len(first) > 20 and 1 <= new(second) <= 2  # its segment (and the next, until a boundary)
    assert ex.load(manifest) == log.state


def test_blocks_removed_and_stored_again_at_the_same_place_are_re_encoded() -> None:
    """The tail's blocks removed and stored again with other tokens: same hashes, same
    positions, same counts; the fingerprint still tells (it is of the content)."""
    log = Log()
    for i in range(100):
        log.put("a", stored([i + 1], tok=1))
    ex = Exporter(log.state)
    ex.export()
    tail = list(range(61, 101))
    log.put("a", BlockRemoved(tuple(tail), "GPU"))
    for h in tail:
        log.put("a", stored([h], tok=50))
    second, manifest = ex.export()
    assert new(second) >= 1
    back = ex.load(manifest)
    assert back == log.state and back.blocks("a", "GPU")[100].token_ids == (50, 51)


def test_a_block_stored_over_itself_is_re_encoded() -> None:
    log = Log()
    for i in range(200):
        log.put("a", stored([i + 1]))
    ex = Exporter(log.state)
    ex.export()
    log.put("a", stored([20], tok=9))  # resident: stays in place, its event replaced
    second, manifest = ex.export()
    assert new(second) == 1
    assert ex.load(manifest).blocks("a", "GPU")[20].token_ids == (9, 10)


def test_an_unchanged_state_reencodes_nothing_and_a_fence_is_in_the_manifest() -> None:
    log = Log()
    for i in range(300):
        log.put("a", stored([i + 1]))
    ex = Exporter(log.state)
    first, _ = ex.export()
    log.put("a", BlockRemoved((10**6,), "GPU"))  # unknown: the fence moves, no block does
    second, manifest = ex.export()
    assert new(second) == 0 and [p.address for p in second] == [p.address for p in first]
    assert manifest.fences == (("a", 1, 301),) and ex.load(manifest).fence("a") == (1, 301)


def test_boundaries_follow_the_blocks_not_their_positions() -> None:
    rnd = random.Random(3)
    keys = [rnd.getrandbits(64) for _ in range(5000)]
    cuts = Cuts(16, 64, 512)
    ends = {keys[e - 1] for _, e in segments(keys, cuts)}
    shifted = keys[100:]  # blocks removed at the front: the later boundaries are the same blocks
    later = {shifted[e - 1] for _, e in segments(shifted, cuts)}
    assert len(ends) > 40 and len(ends & later) >= len(ends) - 3
    sizes = [e - s for s, e in segments(keys, cuts)]
    assert sum(sizes) == 5000 and max(sizes) <= 512 and min(sizes[:-1]) >= 16


def test_a_sequence_of_hashes_that_are_all_boundaries_still_makes_min_sized_chunks() -> None:
    keys = [0] * 1000  # mixes to 0: every block is a boundary candidate
    sizes = [e - s for s, e in segments(keys, Cuts(100, 1024, 4096))]
    assert sizes == [100] * 10


def _segments_per_block(keys: Sequence[int], cuts: Cuts) -> list[tuple[int, int]]:
    """The boundary rule written out a block at a time (the module docstring's)."""
    shift, out, start = 64 - (cuts.avg.bit_length() - 1), [], 0
    while start < len(keys):
        last = min(start + cuts.max, len(keys)) - 1
        i = min(start + cuts.min - 1, last)
        while shift < 64 and i < last and ((keys[i] * 0x9E3779B97F4A7C15) % 2**64) >> shift:
            i += 1
        out.append((start, i + 1))
        start = i + 1
    return out


@pytest.mark.parametrize("cuts", [Cuts(), Cuts(1, 1, 1), Cuts(1, 2, 3), Cuts(4, 8, 32), Cuts(1, 1, 8),
                                  Cuts(16, 64, 512)])
def test_segments_follow_the_rule_block_by_block(cuts: Cuts) -> None:
    """segments tests every hash at once (numpy); its cuts are the per-block rule's exactly,
    for random hashes, small ones, the largest 64-bit ones, and a hash past 64 bits."""
    rnd = random.Random(cuts.max)
    for n in (0, 1, cuts.min, cuts.max + 1, 3000):
        keys = [rnd.choice((rnd.getrandbits(64), rnd.randrange(100), 2**64 - 1 - rnd.randrange(9)))
                for _ in range(n)]
        assert list(segments(keys, cuts)) == _segments_per_block(keys, cuts)
    wide = [rnd.getrandbits(64) for _ in range(200)] + [2**70]
    assert list(segments(wide, cuts)) == _segments_per_block(wide, cuts)


def test_segments_of_single_block_events_are_cut_as_encode_segment_cuts_them() -> None:
    """Segments whose blocks are each a single-block event of their own take a shorter path
    (the events encoded once); their chunks and fingerprints are the general path's, and a
    segment with a chain link, a provenance or a multi-block event takes the general one."""
    rnd = random.Random(5)
    events: list[BlockStored] = []
    for i in range(3000):
        h = rnd.getrandbits(64)
        if i % 997 == 500:  # a link: this block's parent is the block before it
            events.append(stored([h], parent=events[-1].block_hashes[0]))
        elif i % 1301 == 700:
            events.append(BlockStored((h,), None, (1, 2), 2, "CPU", provenance="fleet:n2"))
        elif i % 1701 == 900:
            events.append(stored([h, h ^ 1, h ^ 2]))
        else:
            events.append(BlockStored((h,), rnd.choice((None, 7)), (i, i + 1), 2, "CPU",
                                      lora_name=rnd.choice((None, "l")),
                                      extra_keys=rnd.choice((None, (("x",),)))))
    keys = [h for e in events for h in e.block_hashes]
    values = [e for e in events for _ in e.block_hashes]
    tier = dict(zip(keys, values, strict=True))
    got = list(cut_tail("s", "CPU", 0, 0, keys, values, Cuts(64, 256, 1024), {}, set()))
    assert len(got) > 5
    start = 0
    for piece in got:
        part = keys[start:piece.end]
        assert piece.data == encode_segment("s", "CPU", 0, tier, part)
        assert piece.fingerprint == fingerprint("s", "CPU", 0, part, values[start:piece.end])
        start = piece.end
    assert start == len(keys)


def test_readers_refuse_a_format_they_do_not_know() -> None:
    manifest = Manifest("1-e", 1, "e", 0.0, (0,), 0, 3, ("ab",))
    with pytest.raises(CheckpointBroken, match="format 3 is newer"):
        chunk_keys(LogKeys(), manifest)
    with pytest.raises(CheckpointBroken, match="format 3 is newer"):
        decode_snapshot(manifest, [b""])


def test_a_format_2_manifest_read_as_format_1_lists_a_chunk_that_does_not_exist() -> None:
    """A reader from before format 2 computes format 1 keys from ``checksums``: (0,) makes it
    ask for ``ckpt:{id}:0``, which no daemon writes any more: it leaves the checkpoint out."""
    manifest = Manifest("7-e", 7, "e", 0.0, (0,), 0, 2, ("ab",))
    old_reader_keys = [LogKeys().checkpoint_chunk(manifest.ckpt_id, i) for i in range(len(manifest.checksums))]
    assert old_reader_keys and not set(old_reader_keys) & set(chunk_keys(LogKeys(), manifest))
    with pytest.raises(CheckpointBroken, match="checksum mismatch"):
        decode_snapshot(manifest, [b"\x90"])  # bytes whose address is not "ab"
