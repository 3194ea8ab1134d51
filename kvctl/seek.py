"""A log held in memory for random access: the state at any offset and the change between two.

``kvctl web`` asks for states in any order as a slider moves. Each is rebuilt by the one reducer
(:class:`events.state.CacheState`) from the nearest kept state at or before it: the state the
log starts from (offset 0 or a checkpoint), an export whenever replaying up to it would cost
well more than restoring it, and the state after each jump over a gap (kvctl.logsource restores
the state it hands over in place there), all taken in the one pass that loads the log. That
pass also keeps the violations the reducer found and the resident blocks per tier along the
log, downsampled, for the page's overview.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_right
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any

from events.schema import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, LogRecord, Medium
from events.state import CacheState, Snapshot, Violation
from kvctl.diff import tier_changes
from kvctl.errors import KvctlError

OVERVIEW_POINTS = 400
SAMPLE_HASHES = 10
MAX_CHAINS = 100
RECENT_STATES = 8
KEEP_RATIO = 4.0  # applying since the last copy / what that copy took (a restore costs about as much)
MIN_COPY_S = 0.01


def hash_text(h: int) -> str:
    """A 64-bit hash as JSON text: decimal, as kvctl prints it (a JS number loses digits)."""
    return str(h)


class SeekableLog:
    """The records of one log and states kept along it; offsets from ``start`` to ``last``."""

    def __init__(self, state: CacheState, records: Iterable[LogRecord],
                 keep_every: int | None = None) -> None:
        """Apply ``records`` to ``state`` (the state they follow, which the source may restore
        in place at a gap), keeping a copy every ``keep_every`` records; by default whenever
        the records applied since the last copy took :data:`KEEP_RATIO` times longer than that
        copy did (a copy costs per resident block, a record far less: a small state is copied
        often, a large one rarely, and copying takes at most about a fifth of the load)."""
        if keep_every is not None and keep_every <= 0:
            raise ValueError(f"keep_every must be > 0, got {keep_every}")
        self.start = state.offset
        self.records: list[LogRecord] = []
        # (records applied, the state then), in order: where a rebuild starts.
        self._kept: list[tuple[int, Snapshot]] = []
        keep = _Keeper(self._kept, keep_every)
        keep(0, state)
        overview = _Overview(OVERVIEW_POINTS)
        for record in records:
            if self.records and state.offset != self.records[-1].offset:  # restored at a gap
                keep(len(self.records), state)
            state.apply(record)
            self.records.append(record)
            keep.applied(len(self.records), state)
            overview.add(state)
        self.violations: list[Violation] = list(state.violations)
        self.sources = state.sources()
        self._offsets = [r.offset for r in self.records]
        self._kept_at = [count for count, _ in self._kept]
        self._overview = overview.points(state)
        self._recent: OrderedDict[int, CacheState] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def num_kept(self) -> int:
        """How many states are kept (the start's included)."""
        return len(self._kept)

    @property
    def last(self) -> int:
        return self._offsets[-1] if self._offsets else self.start

    def check(self, offset: int) -> None:
        """KvctlError unless ``offset`` is one the log can be rebuilt at."""
        if offset > self.last:
            raise KvctlError(f"offset {offset} is beyond the end of the log (last offset {self.last})")
        if offset < self.start:
            raise KvctlError(f"offset {offset} is before the log's start (the checkpoint at "
                             f"offset {self.start})")

    def state_at(self, offset: int) -> CacheState:
        """The reducer's state after every record at or before ``offset`` (the caller reads
        it, never changes it: the last few are shared, as a page asks for the same offsets
        again for its state and its diff)."""
        self.check(offset)
        count = bisect_right(self._offsets, offset)
        with self._lock:
            cached = self._recent.get(offset)
            if cached is not None:
                self._recent.move_to_end(offset)
                return cached
        from_count, snap = self._kept[bisect_right(self._kept_at, count) - 1]
        if from_count == count and snap.offset > offset:  # a state restored after a gap
            before = self.records[count - 1].offset if count else self.start
            if offset > before:
                raise KvctlError(f"offset {offset} is in a gap of the log (offsets {before + 1}.."
                                 f"{snap.offset - 1} are missing): states are known at offset "
                                 f"{before} and from offset {snap.offset} on")
            from_count, snap = self._kept[bisect_right(self._kept_at, count) - 2]
        state = CacheState.from_snapshot(snap)
        for record in self.records[from_count:count]:
            state.apply(record)
        with self._lock:
            self._recent[offset] = state
            while len(self._recent) > RECENT_STATES:
                self._recent.popitem(last=False)
        return state

    def record_at(self, offset: int) -> LogRecord | None:
        """The last record at or before ``offset`` (None before the first)."""
        count = bisect_right(self._offsets, offset)
        return self.records[count - 1] if count else None

    # -- JSON for the page ----------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        first = self.records[0] if self.records else None
        return {
            "start": self.start,
            "last": self.last,
            "records": len(self.records),
            "from_checkpoint": self.start > 0,
            "t_first": None if first is None else first.ts,
            "t_last": None if first is None else self.records[-1].ts,
            "sources": self.sources,
            "num_violations": len(self.violations),
            "overview": [list(p) for p in self._overview],
        }

    def state_json(self, offset: int, chains_of: str | None = None,
                   with_chains: bool = True) -> dict[str, Any]:
        """Per source and tier: blocks and, ``with_chains``, chains (runs of chained blocks as
        the reducer's export makes them; ``null`` without); the record that led here; the
        violations so far; with ``chains_of``, that source's chains, longest first. The export
        is most of the cost at a large state, so a page can ask for the counts first."""
        state = self.state_at(offset)
        runs: dict[tuple[str, Medium, int], list[BlockStored]] = {}
        snap: Snapshot | None = None
        if with_chains or chains_of is not None:
            snap = state.export()
            for src in snap.sources:
                for event in src.events:
                    runs.setdefault((src.source, event.medium, event.group_idx), []).append(event)
        tiers_of: dict[str, list[dict[str, Any]]] = {source: [] for source in state.sources()}
        totals = dict.fromkeys(MEDIA, 0)
        for (source, medium, group), n in sorted(state.counts().items()):
            totals[medium] += n
            events = runs.get((source, medium, group), []) if with_chains else []
            tiers_of[source].append({
                "medium": medium, "group_idx": group, "blocks": n,
                "chains": len(events) if events else None,
                "longest_chain": max(len(e.block_hashes) for e in events) if events else None,
            })
        sources = []
        for source, tiers in tiers_of.items():
            fence = state.fence(source)
            sources.append({"source": source, "fence": list(fence) if fence else None,
                            "tiers": tiers})
        seen = [v for v in self.violations if v.offset <= offset]
        out: dict[str, Any] = {
            "offset": offset, "record": _record_json(self.record_at(offset)),
            "sources": sources, "totals": totals, "num_violations": len(seen),
            "violations": [_violation_json(v) for v in seen[-20:]],
        }
        if chains_of is not None:
            assert snap is not None
            out["chains"] = _chains_json(snap, chains_of, state)
        return out

    def diff_json(self, a: int, b: int) -> dict[str, Any]:
        if a > b:
            raise KvctlError(f"A ({a}) must not be after B ({b})")
        changes = tier_changes(self.state_at(a), self.state_at(b))
        rows = [
            {"source": s, "medium": m, "group_idx": g, "added": len(add), "removed": len(rem),
             "added_sample": [hash_text(h) for h in add[:SAMPLE_HASHES]],
             "removed_sample": [hash_text(h) for h in rem[:SAMPLE_HASHES]]}
            for (s, m, g), (add, rem) in changes.items()
        ]
        return {"from": a, "to": b, "changes": rows,
                "added": sum(r["added"] for r in rows), "removed": sum(r["removed"] for r in rows)}


def _chains_json(snap: Snapshot, source: str, state: CacheState) -> list[dict[str, Any]]:
    match = [s for s in snap.sources if s.source == source]
    if not match:
        known = ", ".join(state.sources()) or "none"
        raise KvctlError(f"no source {source!r} at offset {snap.offset} (known: {known})")
    events = sorted(match[0].events, key=lambda e: -len(e.block_hashes))[:MAX_CHAINS]
    return [{"medium": e.medium, "group_idx": e.group_idx, "blocks": len(e.block_hashes),
             "first": hash_text(e.block_hashes[0]), "last": hash_text(e.block_hashes[-1]),
             "parent": None if e.parent_block_hash is None else hash_text(e.parent_block_hash)}
            for e in events]


def _record_json(record: LogRecord | None) -> dict[str, Any] | None:
    if record is None:
        return None
    events: list[dict[str, Any]] = []
    for e in record.events:
        kind = type(e).__name__
        if isinstance(e, BlockStored | BlockRemoved):
            events.append({"type": kind, "medium": e.medium, "group_idx": e.group_idx,
                           "blocks": len(e.block_hashes)})
        elif isinstance(e, AllBlocksCleared):
            events.append({"type": kind, "medium": e.medium})
    return {"offset": record.offset, "source": record.source, "incarnation": record.incarnation,
            "source_seq": record.source_seq, "ts": record.ts, "events": events}


def _violation_json(v: Violation) -> dict[str, Any]:
    return {"offset": v.offset, "source": v.source, "kind": v.kind, "detail": v.detail}


class _Keeper:
    """Decides when :class:`SeekableLog` keeps a copy of the state, and keeps it."""

    def __init__(self, kept: list[tuple[int, Snapshot]], every: int | None) -> None:
        self.kept, self.every = kept, every
        self.since = 0
        self.copy_s = 0.0  # what the last copy took
        self.mark = time.perf_counter()  # when applying since the last copy began

    def __call__(self, count: int, state: CacheState) -> None:
        t0 = time.perf_counter()
        self.kept.append((count, state.export()))
        self.mark = time.perf_counter()
        self.copy_s, self.since = self.mark - t0, 0

    def applied(self, count: int, state: CacheState) -> None:
        self.since += 1
        if self.every is not None:
            due = self.since >= self.every
        else:  # the clock is read now and then, not per record
            due = self.since % 256 == 0 and (
                time.perf_counter() - self.mark >= KEEP_RATIO * max(self.copy_s, MIN_COPY_S))
        if due:
            self(count, state)


class _Overview:
    """Resident blocks per tier along the log at between ``n`` and ``2n`` evenly spaced records
    (and the last): the stride doubles as the log grows, so the counting costs O(n log records)
    rather than a count per record."""

    def __init__(self, n: int) -> None:
        self.n, self.stride, self.seen = n, 1, 0
        self.taken: list[tuple[int, int, int]] = []

    def add(self, state: CacheState) -> None:
        self.seen += 1
        if self.seen % self.stride:
            return
        self.taken.append(_totals(state))
        if len(self.taken) >= 2 * self.n:
            self.taken = self.taken[1::2]  # the points at multiples of the doubled stride
            self.stride *= 2

    def points(self, state: CacheState) -> list[tuple[int, int, int]]:
        if self.seen and self.seen % self.stride:
            return [*self.taken, _totals(state)]
        return self.taken


def _totals(state: CacheState) -> tuple[int, int, int]:
    per_medium: Counter[str] = Counter()
    for (_s, medium, _g), n in state.counts().items():
        per_medium[medium] += n
    return state.offset, per_medium["GPU"], per_medium["CPU"]
