"""Format 2 checkpoint chunks: each tier cut by content, so a checkpoint costs what changed.

A tier of CacheState is a dict in insertion order: a stored block is appended at its end, a
removed one leaves its place, and nothing is ever inserted in the middle. Each tier's blocks are
cut into segments in that order, with a boundary after a block whose (mixed) hash falls in one
of ``Cuts.avg`` buckets, once the segment holds ``Cuts.min`` blocks, and at ``Cuts.max`` blocks
at the latest. The boundaries are a property of the blocks, not of their positions: appends
change only the tier's last segment (and add new ones), a removal only its own segment (and the
next, until a boundary is met again). A segment is one chunk: a msgpack tuple with one
SourceSnapshot of the blocks (chains merged into one event as ``CacheState.export`` does),
zlib-compressed (level 1: the events' field names are most of the msgpack bytes), and
no fence (fences change with every record: they are in the manifest). A chunk is stored under
its content address (events.checkpoint.chunk_address), so checkpoints share their unchanged
chunks.

The exporter does not even re-encode an unchanged segment: its *fingerprint* is a seeded
xxh3-128 of what the chunk is made of (source, tier, the block hashes, which of them share a stored event,
and those events' msgpack), computed in C without a Python step per block, so an equal
fingerprint means the same chunk bytes. It costs a fraction of an encoding (no chains built, no
compression) and nothing of the daemon (DECISIONS 60: an earlier form fingerprinted events by
``id()`` and had the daemon hold every event alive in between; taking those references wrote to
every event's page after each fork, a fault storm on the event loop). And a tier is not even
walked where it did not change since the previous export: events.checkpoint_delta reuses those
segments and cuts only the rest (``cut_tail``).
"""

from __future__ import annotations

import os
import zlib
from array import array
from bisect import bisect_left
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import count, islice
from operator import attrgetter, eq

import msgspec
import xxhash

from events.checkpoint import chunk_address
from events.schema import BlockStored, Medium
from events.state import CacheState, SourceSnapshot
from events.state_chains import chain_event, same_kind
from events.state_tier import Tier, positions

_MIX = 0x9E3779B97F4A7C15  # odd: a bijection of 64-bit hashes, so sequential hashes spread
_MASK = (1 << 64) - 1
# Fingerprints are compared only within one process (and its forked children): a secret seed
# keeps a client from crafting two segments with one fingerprint (xxh3 is not a cryptographic
# hash; chunk addresses, which outlive the process, are blake2b).
_SEED = int.from_bytes(os.urandom(8), "little")

_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class Cuts:
    """Segment sizes in blocks: at least ``min`` (but a tier's last), ``avg`` on average
    (a power of two), at most ``max``."""

    min: int = 256
    avg: int = 1024
    max: int = 4096

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.max or self.avg < 1 or self.avg & (self.avg - 1):
            raise ValueError(f"bad cuts {self}: need 1 <= min <= max and avg a power of two")


@dataclass(frozen=True)
class Piece:
    """One chunk of a checkpoint, in order: its address and length, the fingerprint of the
    segment it holds, its bytes unless Redis holds them already (``data`` None), where the
    segment ends in its tier (a position in insertion order; the tier's length for its last)
    and, from the cut that made it, the segment's block hashes (``keys``: what a checkpoint
    writer maps back to segments, events.checkpoint_delta; None on a piece reused uncut)."""

    address: str
    length: int
    fingerprint: bytes
    data: bytes | None
    end: int = 0
    keys: Sequence[int] | None = None


def segments(keys: Sequence[int], cuts: Cuts) -> Iterator[tuple[int, int]]:
    """``[start, end)`` of each segment of a tier whose hashes are ``keys`` (module docstring).
    The boundary test runs over all the hashes at once in numpy (~10 ns a block instead of a
    Python step each); a hash outside 0..2**64-1 takes a per-block pass, same rule. numpy is
    imported at the first call, not with the module: the daemon imports this module before it
    serves, and its first checkpoint comes after (~70 ms less to SERVING)."""
    n = len(keys)
    marks = _marks(keys, 64 - (cuts.avg.bit_length() - 1))
    start = 0
    while start < n:
        last = min(start + cuts.max, n) - 1
        i = min(start + cuts.min - 1, last)
        at = bisect_left(marks, i)  # the first boundary candidate from the segment's minimum on
        i = marks[at] if at < len(marks) and marks[at] < last else last
        yield start, i + 1
        start = i + 1


def _marks(keys: Sequence[int], shift: int) -> Sequence[int]:
    """The positions, ascending, whose hash may end a segment: its mixed hash's top bits all 0
    (shift 64, an ``avg`` of 1: every position)."""
    if shift >= 64:
        return range(len(keys))
    try:
        packed = keys if isinstance(keys, array) else array("Q", keys)
    except OverflowError:
        return [i for i, k in enumerate(keys) if not ((k * _MIX) & _MASK) >> shift]
    import numpy as np  # here, not at the top (segments' docstring: off the daemon's start)

    mixed = np.frombuffer(packed, dtype=np.uint64) * np.uint64(_MIX)  # wraps: mod 2**64
    marks: list[int] = np.flatnonzero((mixed >> np.uint64(shift)) == 0).tolist()
    return marks


def preload() -> None:
    """Import what :func:`segments` imports at its first call (numpy, ~70 ms): a daemon calls
    it in a thread once it serves, so its first cut in the loop does not stall the loop."""
    import numpy  # noqa: F401


def fingerprint(source: str, medium: Medium, group: int, keys: list[int], events: list[BlockStored]) -> bytes:
    """What a segment's chunk is made of (module docstring), in C: the hashes; per block a
    number shared by the blocks of one stored event (the first one's position, from ``count``),
    and the distinct events' msgpack in order of first appearance."""
    first: dict[int, int] = {}
    ids = array("Q", map(first.setdefault, map(id, events), count()))
    body = _encoder.encode(list(dict(zip(map(id, events), events, strict=True)).values()))
    return _digest(source, medium, group, array("Q", keys), ids, body)


def _digest(source: str, medium: Medium, group: int, keys: array[int] | memoryview, ids: array[int],
            body: bytes) -> bytes:
    h = xxhash.xxh3_128(f"{source}\0{medium}\0{group}\0".encode(), seed=_SEED)
    h.update(keys)
    h.update(ids)
    h.update(body)
    return h.digest()


_hashes, _parent, _provenance = (attrgetter(f) for f in ("block_hashes", "parent_block_hash", "provenance"))


def _plain_body(keys: list[int], events: list[BlockStored]) -> bytes | None:
    """The msgpack of ``events`` when each block of the segment is a single-block event of its
    own that no chain merges and the chunk holds as it is (no provenance, no block whose parent
    is the block before it: what encode_segment would write is exactly ``events``); else None.
    Tested in C over the segment: the common case skips encode_segment's step per block and
    encodes the events once, for the fingerprint and the chunk both."""
    if (set(map(len, map(_hashes, events))) != {1} or set(map(_provenance, events)) != {None}
            or any(map(eq, map(_parent, islice(events, 1, None)), keys))
            or len(set(map(id, events))) != len(events)):
        return None
    return _encoder.encode(events)


def _plain_chunk(source: str, body: bytes) -> bytes:
    """The chunk encode_segment makes of ``events`` whose msgpack is ``body`` (_plain_body)."""
    raw = msgspec.Raw(body)
    return zlib.compress(_encoder.encode((SourceSnapshot(source, 0, 0, raw),)), 1)  # type: ignore[arg-type]


def encode_segment(source: str, medium: Medium, group: int, tier: Tier, keys: list[int]) -> bytes:
    """The chunk of one segment: its blocks in order, runs that chain merged into one event."""
    out: list[BlockStored] = []
    at: dict[int, int] = {}
    index: dict[int, dict[int, int]] = {}  # id(event) -> positions; the tier keeps each alive
    chain: list[int] = []
    head: BlockStored | None = None
    head_parent: int | None = None
    for h in keys:
        ev = tier[h]
        hashes = ev.block_hashes
        if len(hashes) == 1:
            i, parent = 0, ev.parent_block_hash
        else:
            where = index.get(id(ev))
            if where is None:
                where = index[id(ev)] = positions(hashes)
            i = where[h]
            parent = ev.parent_block_hash if i == 0 else hashes[i - 1]
        at[h] = i
        if head is not None and parent == chain[-1] and same_kind(ev, head):
            chain.append(h)
            continue
        if head is not None:
            out.append(_as_event(tier, head, head_parent, at, chain, medium, group))
        chain, head, head_parent = [h], ev, parent
    if head is not None:
        out.append(_as_event(tier, head, head_parent, at, chain, medium, group))
    return zlib.compress(_encoder.encode((SourceSnapshot(source, 0, 0, tuple(out)),)), 1)


TierItem = tuple[str, Medium, int, Tier]  # as CacheState.tiers yields them


def _as_event(tier: Tier, head: BlockStored, head_parent: int | None, at: dict[int, int],
              chain: list[int], medium: Medium, group: int) -> BlockStored:
    """The chain's event: the stored one itself when it is exactly that one block (the common
    single-block store: nothing rebuilt), else one built as ``CacheState.export`` does."""
    if len(chain) == 1 and len(head.block_hashes) == 1 and head.provenance is None:
        return head
    return chain_event(tier, head_parent, at, chain, medium, group)


def pieces(tiers: Iterable[TierItem], cuts: Cuts, known: Mapping[bytes, tuple[str, int]],
           present: Container[str]) -> Iterator[Piece]:
    """The chunks of ``tiers`` (``CacheState.tiers()``, or copies of them), in order, every
    block cut. ``known``: fingerprint -> (address, length) of segments exported before;
    ``present``: addresses Redis holds (no bytes are produced for those)."""
    for source, medium, group, tier in tiers:
        yield from cut_tail(source, medium, group, 0, list(tier), list(tier.values()), cuts, known,
                            present)


def cut_tail(source: str, medium: Medium, group: int, start: int, keys: list[int],
             values: list[BlockStored], cuts: Cuts, known: Mapping[bytes, tuple[str, int]],
             present: Container[str]) -> Iterator[Piece]:
    """The chunks of one tier's blocks from position ``start`` on (``keys`` and ``values``
    from there to its end), ``start`` a segment's start: the segments from there are the
    whole tier's from there, since a boundary depends only on the blocks since the last one."""
    packed = array("Q", keys)  # hashes are 64-bit (as fingerprints have always required)
    yield from cut_segments(source, medium, group, start, keys, values, packed,
                            segments(packed, cuts), known, present)


def cut_segments(source: str, medium: Medium, group: int, start: int, keys: list[int],
                 values: list[BlockStored], packed: array[int], bounds: Iterable[tuple[int, int]],
                 known: Mapping[bytes, tuple[str, int]], present: Container[str]) -> Iterator[Piece]:
    """The chunks of the segments ``bounds`` (``[a, b)`` of ``keys``, ``values`` and
    ``packed``, their hashes as an array) of a run of a tier that starts at position ``start``:
    cut_tail's, or a part of them for a caller that reads a tier a window at a time (the
    segments it knows to be complete)."""
    for a, b in bounds:
        part, events = keys[a:b], values[a:b]
        body = _plain_body(part, events)
        if body is None:
            fp = fingerprint(source, medium, group, part, events)
        else:
            fp = _digest(source, medium, group, memoryview(packed)[a:b], array("Q", range(b - a)), body)
        hit = known.get(fp)
        if hit is not None and hit[0] in present:
            yield Piece(hit[0], hit[1], fp, None, start + b, part)
            continue
        if body is None:
            data = encode_segment(source, medium, group, dict(zip(part, events, strict=True)), part)
        else:
            data = _plain_chunk(source, body)
        address = chunk_address(data)
        yield Piece(address, len(data), fp, None if address in present else data, start + b, part)


def fences(state: CacheState) -> tuple[tuple[str, int, int], ...]:
    """Every source's ``(source, incarnation, last_seq)`` (0, 0: unfenced), sorted."""
    return tuple((s, *(state.fence(s) or (0, 0))) for s in state.sources())
