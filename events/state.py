"""CacheState: the one pure reducer of log records into "which block is where" (DESIGN.md 3.2).

The daemon's recovery, the bridge, subscribers, tests and ``kvctl replay`` all call
:meth:`CacheState.apply`. It does no I/O and never raises on bad content: anything odd in the
log is recorded as a :class:`Violation` so that replays can report it. How records change the
tiers is events.state_apply; what changed besides appends, events.state_changes; a state as
plain data (:class:`Snapshot`), events.state_snapshot.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, KeysView, Mapping, Sequence
from types import MappingProxyType
from typing import Final

import msgspec

from events.schema import MEDIA, BlockHash, LogRecord, Medium
from events.state_apply import apply_events
from events.state_changes import EditBook, TierChanges, TierKey
from events.state_snapshot import Snapshot, SourceSnapshot, snapshot_of, tiers_of
from events.state_tier import BlockEntry, Tier, TierView

__all__ = [  # Snapshot and SourceSnapshot live in events.state_snapshot; imported from here too
    "TIER_WEIGHTS", "ApplyResult", "BlockEntry", "CacheState", "PrefixMatch", "Snapshot",
    "SourceSnapshot", "Violation",
]

TIER_WEIGHTS: Final[Mapping[Medium, float]] = MappingProxyType({"GPU": 1.0, "CPU": 0.8})

_EMPTY: Final[Mapping[int, BlockEntry]] = MappingProxyType({})
_NO_KEYS: Final[KeysView[int]] = {}.keys()


class Violation(msgspec.Struct, frozen=True):
    """An inconsistency found in the log; kinds: unknown_block_removed, orphan_child,
    stale_incarnation, log_gap, source_gap, invalid_event."""

    offset: int
    source: str
    kind: str
    detail: str


class ApplyResult(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    STALE = "stale"


class PrefixMatch(msgspec.Struct, frozen=True):
    num_blocks: int
    num_gpu: int
    num_cpu: int
    score: float


class CacheState:
    """Resident blocks per (source, medium, group_idx), fenced per source."""

    def __init__(self) -> None:
        self._offset = 0
        self._tiers: dict[str, dict[TierKey, Tier]] = {}
        self._fences: dict[str, tuple[int, int]] = {}
        # Per source and tier, changes other than appends (events.state_apply; :meth:`edits`).
        self._edit_book = EditBook()
        self._edits = self._edit_book.by_source  # the hot path's look-up
        self.violations: list[Violation] = []

    @property
    def offset(self) -> int:
        """The last applied log offset (0 = none)."""
        return self._offset

    # -- applying -------------------------------------------------------------------------

    def apply(self, record: LogRecord) -> ApplyResult:
        """Apply one record; records must come in offset order."""
        # The hot path of every consumer (events.state_apply): the common fence case, the next
        # seq of the current incarnation, is checked inline.
        offset, source = record.offset, record.source
        last = self._offset
        if offset <= last:
            return ApplyResult.DUPLICATE
        if offset > last + 1:
            self._violate(offset, source, "log_gap", f"expected offset {last + 1}")
        self._offset = offset
        inc = record.incarnation
        if inc != 0:  # 0: rebuilt from a ZMQ stream, nothing to fence on
            known = self._fences.get(source)
            seq = record.source_seq
            if known is not None and known[0] == inc and seq == known[1] + 1:
                self._fences[source] = (inc, seq)
            else:
                fenced = self._fence(record)
                if fenced is not ApplyResult.APPLIED:
                    return fenced
        tiers = self._tiers.get(source)
        if tiers is None:
            tiers = self._tiers[source] = {}
        edits = self._edits.get(source)
        if edits is None:
            edits = self._edit_book.of(source)
        apply_events(tiers, record.events, offset, source, self._violate, edits)
        return ApplyResult.APPLIED

    def _fence(self, record: LogRecord) -> ApplyResult:
        source, inc, seq = record.source, record.incarnation, record.source_seq
        known = self._fences.get(source)
        if known is not None and inc < known[0]:
            self._violate(
                record.offset,
                source,
                "stale_incarnation",
                f"incarnation {inc} < current {known[0]}",
            )
            return ApplyResult.STALE
        if known is None or inc > known[0]:
            # A new incarnation starts from nothing; the first fence seen for a source clears
            # nothing (its earlier blocks, if any, came unfenced and stay).
            if known is not None:
                self._bump(source, self._tiers.get(source, {}))
                self._tiers[source] = {}
            if seq != 1:
                self._violate(
                    record.offset,
                    source,
                    "source_gap",
                    f"incarnation {inc} starts at seq {seq}, expected 1",
                )
        else:
            if seq <= known[1]:
                return ApplyResult.DUPLICATE
            if seq > known[1] + 1:
                self._violate(
                    record.offset,
                    source,
                    "source_gap",
                    f"seq {seq} after {known[1]} in incarnation {inc}",
                )
        self._fences[source] = (inc, seq)
        return ApplyResult.APPLIED

    def _bump(self, source: str, keys: Iterable[TierKey]) -> None:
        """The tiers ``keys`` of ``source`` are replaced or cleared."""
        edits = self._edit_book.of(source)
        for key in keys:
            edits.reset(key)

    def track_changes(self) -> None:
        """Record, from now on, what each change other than an append was (the hashes
        removed, the hashes stored again, a tier cleared or replaced), for
        :meth:`take_changes`: what an incremental checkpoint needs to re-cut only the
        segments a removal touched (events.checkpoint_delta). Off by default: a consumer that
        never takes them would keep every removed hash."""
        self._edit_book.track()

    def take_changes(self) -> dict[tuple[str, Medium, int], TierChanges]:
        """What changed per tier other than by appends since the last call (or since
        :meth:`track_changes`), and forget it; empty when not tracking."""
        return self._edit_book.take()

    def pending_changes(self, source: str, medium: Medium, group_idx: int = 0) -> TierChanges | None:
        """What :meth:`take_changes` would return for this tier now (None: nothing), left to
        it: the same object, growing until taken, ``reset`` once the tier is cleared or
        replaced (a checkpoint export reading a tier after its instant watches it)."""
        return self._edit_book.pending(source, (medium, group_idx))

    def _violate(self, offset: int, source: str, kind: str, detail: str) -> None:
        self.violations.append(Violation(offset, source, kind, detail))

    # -- queries --------------------------------------------------------------------------

    def fence(self, source: str) -> tuple[int, int] | None:
        """``(incarnation, last_seq)`` of a fenced source; None when unknown or unfenced."""
        return self._fences.get(source)

    def sources(self) -> list[str]:
        return sorted(self._tiers.keys() | self._fences.keys())

    def blocks(self, source: str, medium: Medium, group_idx: int = 0) -> Mapping[int, BlockEntry]:
        tier = self._tiers.get(source, {}).get((medium, group_idx))
        return _EMPTY if tier is None else TierView(tier)

    def resident(self, source: str, medium: Medium, group_idx: int = 0) -> KeysView[int]:
        """The tier's hashes, live and read-only: a membership test in C, for hot paths (the
        router scores every engine per request) where ``blocks`` would build entries."""
        tier = self._tiers.get(source, {}).get((medium, group_idx))
        return _NO_KEYS if tier is None else tier.keys()

    def has(self, source: str, medium: Medium, block_hash: int, group_idx: int = 0) -> bool:
        tier = self._tiers.get(source, {}).get((medium, group_idx))
        return tier is not None and block_hash in tier

    def longest_prefix(
        self,
        hashes: Sequence[BlockHash],
        group_idx: int = 0,
        weights: Mapping[Medium, float] = TIER_WEIGHTS,
    ) -> dict[str, PrefixMatch]:
        """Per source, the leading run of ``hashes`` (wire form, see events.hashing.to_wire)
        resident in some tier.

        Each block counts in its best (highest-weight) tier; sources with no match are omitted.
        """
        out: dict[str, PrefixMatch] = {}
        ranked = sorted(MEDIA, key=lambda m: -weights.get(m, 0.0))
        for source, tiers in self._tiers.items():
            present = [(m, tiers[(m, group_idx)]) for m in ranked if (m, group_idx) in tiers]
            counts = {"GPU": 0, "CPU": 0}
            score = 0.0
            for h in hashes:
                for medium, tier in present:
                    if h in tier:
                        counts[medium] += 1
                        score += weights.get(medium, 0.0)
                        break
                else:
                    break
            total = counts["GPU"] + counts["CPU"]
            if total:
                out[source] = PrefixMatch(total, counts["GPU"], counts["CPU"], score)
        return out

    def counts(self) -> dict[tuple[str, Medium, int], int]:
        """``(source, medium, group_idx) -> number of resident blocks``, non-zero only."""
        return {(s, m, g): len(t) for s, m, g, t in self._iter_tiers() if t}

    def view(self) -> dict[tuple[str, Medium, int], frozenset[int]]:
        """The canonical content: comparable across states built in different ways."""
        return {(s, m, g): frozenset(t) for s, m, g, t in self._iter_tiers() if t}

    def edits(self, source: str, medium: Medium, group_idx: int = 0) -> int:
        """A count that moves whenever the tier changes other than by blocks appended at its end
        (in insertion order): a block removed or stored again, the tier cleared or replaced (a
        new incarnation, :meth:`restore`). Two reads with one count between them, the second
        tier at least as long: the second is the first with blocks appended (what an
        incremental checkpoint relies on, events.checkpoint_cut). One bump per event, not per
        block, on the apply path."""
        return self._edit_book.count(source, (medium, group_idx))

    def tiers(self) -> Iterator[tuple[str, Medium, int, Tier]]:
        """``(source, medium, group_idx, tier)`` for each tier, sources sorted; each tier is the
        live dict (block hash -> the event that stored it, in insertion order), READ ONLY: for
        exports that must not copy it (the forked checkpoint export, events.checkpoint_cut)."""
        for source in sorted(self._tiers):
            for (medium, group), tier in self._tiers[source].items():
                yield source, medium, group, tier

    def _iter_tiers(self) -> Iterator[tuple[str, Medium, int, Tier]]:
        for source, tiers in self._tiers.items():
            for (medium, group), tier in tiers.items():
                yield source, medium, group, tier

    # -- snapshots ------------------------------------------------------------------------

    def export(self) -> Snapshot:
        """The state as BlockStored events, each parent before any child that references it."""
        return snapshot_of(self._offset, self.sources(), self._tiers, self._fences)

    @classmethod
    def from_snapshot(cls, snap: Snapshot) -> CacheState:
        """Rebuild a state from :meth:`export`; a snapshot is state, so no violations.

        Raises SchemaError on an invalid event (snapshots come from a trusted export).
        """
        state = cls()
        state.restore(snap)
        return state

    def restore(self, snap: Snapshot) -> None:
        """Become the state of ``snap`` in place (for holders shared by others: the daemon's
        one state, a reader jumping over a gap to a checkpoint). The violations found so far
        are kept: they are history, not state. SchemaError on an invalid event, and then this
        state is unchanged."""
        tiers, fences = tiers_of(snap)
        for source in self._tiers.keys() | tiers.keys():  # every tier is replaced
            self._bump(source, self._tiers.get(source, {}).keys() | tiers.get(source, {}).keys())
        self._offset, self._tiers, self._fences = snap.offset, tiers, fences

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CacheState):
            return NotImplemented
        return self._fences == other._fences and self.view() == other.view()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"CacheState(offset={self._offset}, counts={self.counts()})"
