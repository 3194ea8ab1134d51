"""What changed in CacheState's tiers other than appends: per source and tier a count (what
``CacheState.edits`` reads), and, while a checkpoint writer tracks them, which hashes
(``CacheState.take_changes``; events.checkpoint_book places them on the previous checkpoint's
segments). Written only on the reducer's paths that change a tier other than by appending
(events.state_apply), never on an append.
"""

from __future__ import annotations

from events.schema import Medium

TierKey = tuple[Medium, int]  # (medium, group_idx)


class TierChanges:
    """What changed in one tier other than appends, since it was last taken
    (CacheState.take_changes): hashes removed, hashes stored again in place, or the tier
    cleared or replaced (``reset``: what it held before does not matter any more)."""

    __slots__ = ("removed", "reset", "rewritten")

    def __init__(self) -> None:
        self.removed: list[int] = []
        self.rewritten: list[int] = []
        self.reset = False

    def mark_reset(self) -> None:
        self.removed, self.rewritten, self.reset = [], [], True


class TierEdits(dict[TierKey, int]):
    """One source's edit counts per tier (CacheState.edits) and, while a checkpoint writer
    tracks them (CacheState.track_changes), its :class:`TierChanges` per tier. Both are
    written only on the paths that change a tier other than by appending (a removal, a
    hash stored again, a clear), never on an append."""

    __slots__ = ("changes",)

    def __init__(self, changes: dict[TierKey, TierChanges] | None = None) -> None:
        super().__init__()
        self.changes = changes

    def _bump(self, key: TierKey) -> TierChanges | None:
        """Count a change of the tier; its journal when changes are tracked."""
        self[key] = self.get(key, 0) + 1
        return None if self.changes is None else self.journal(key)

    def rewrote(self, key: TierKey, hashes: tuple[int, ...]) -> None:
        """``hashes`` (some of them already resident) were stored again in the tier."""
        journal = self._bump(key)
        if journal is not None:
            journal.rewritten.extend(hashes)

    def reset(self, key: TierKey) -> None:
        """The tier was cleared or replaced."""
        journal = self._bump(key)
        if journal is not None:
            journal.mark_reset()

    def journal(self, key: TierKey) -> TierChanges:
        """The tier's TierChanges (changes tracked only)."""
        assert self.changes is not None
        got = self.changes.get(key)
        if got is None:
            got = self.changes[key] = TierChanges()
        return got


class EditBook:
    """Every source's :class:`TierEdits`, and whether their changes are tracked."""

    def __init__(self) -> None:
        self.by_source: dict[str, TierEdits] = {}
        self._changes: dict[str, dict[TierKey, TierChanges]] | None = None

    def of(self, source: str) -> TierEdits:
        edits = self.by_source.get(source)
        if edits is None:
            changes = None if self._changes is None else self._changes.setdefault(source, {})
            edits = self.by_source[source] = TierEdits(changes)
        return edits

    def count(self, source: str, key: TierKey) -> int:
        edits = self.by_source.get(source)
        return 0 if edits is None else edits.get(key, 0)

    def track(self) -> None:
        if self._changes is None:
            self._changes = {}
            for source, edits in self.by_source.items():
                edits.changes = self._changes.setdefault(source, {})

    def pending(self, source: str, key: TierKey) -> TierChanges | None:
        """The tier's changes since they were last taken, left in place; None when none."""
        return None if self._changes is None else self._changes.get(source, {}).get(key)

    def take(self) -> dict[tuple[str, Medium, int], TierChanges]:
        out: dict[tuple[str, Medium, int], TierChanges] = {}
        for source, per_tier in (self._changes or {}).items():
            for (medium, group), changes in per_tier.items():
                out[(source, medium, group)] = changes
            per_tier.clear()  # the same dict: the source's TierEdits holds it
        return out
