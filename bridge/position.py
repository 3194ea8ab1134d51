"""Where a bridge stopped publishing, saved in Redis so a restart continues without a gap.

The hash ``LogKeys.bridge(name)`` holds ``offset`` (the last log offset published) and, per
published topic, ``seq:{topic}`` (the next seq of that stream). Both are written in one HSET, so
they always agree, with ``epoch`` (the log epoch those offsets belong to, DESIGN 3.5) and, per
topic, ``base:{topic}`` (the seq of the epoch's first record: seqs continue across epochs, so
after one they no longer start at 0). Seqs are derived from the log at start anyway (bridge.seqindex); the saved
values matter when old records were trimmed from the log, and to resume at the right offset.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from bridge.config import StartAt
from events.logreader import LogUnavailable

log = logging.getLogger("kvbridge")


class HashClient(Protocol):
    def get(self, name: str) -> Any: ...

    def hgetall(self, name: str) -> Any: ...

    def hset(self, name: str, key: Any = None, value: Any = None, mapping: Any = None) -> Any: ...


@dataclass(frozen=True)
class SavedPosition:
    offset: int
    next_seqs: dict[str, int] = field(default_factory=dict)
    epoch: str = ""
    base_seqs: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Resume:
    """Where a starting bridge resumes publishing."""

    after: int  # the last offset taken as published
    saved: SavedPosition | None  # the saved position, when it is of this log
    carried: dict[str, int] | None  # the next seqs saved for a log since replaced (a new epoch)


def resume_point(saved: SavedPosition | None, epoch: str | None, head: int, first: int,
                 start: StartAt) -> Resume:
    """A saved position of another log epoch carries its seqs over and publishes the new log
    from offset 1; one beyond the head is dropped (the log was reset); ``start`` says where a
    bridge without one starts (``beginning``: the oldest retained record)."""
    carried: dict[str, int] | None = None
    if saved is not None and saved.epoch and epoch is not None and saved.epoch != epoch:
        log.warning("saved position is of log epoch %s, the log is now epoch %s: the log was "
                    "replaced; publishing it from offset 1, seqs continuing", saved.epoch, epoch)
        carried, saved = saved.next_seqs, None
    if saved is not None and saved.offset > head:
        log.warning("saved position %d is beyond the log head %d (log reset?); starting at the head",
                    saved.offset, head)
        saved = None
    if carried is not None:
        after = 0
    elif start == "beginning":
        after = max(0, first - 1)  # the oldest retained record on
    elif start == "resume" and saved is not None:
        after = saved.offset
    else:
        after = head
    return Resume(after, saved, carried)


class PositionStore:
    def __init__(
        self, client: HashClient, key: str, transient: tuple[type[BaseException], ...] = (OSError,),
        epoch_key: str = "",
    ) -> None:
        self._client = client
        self._key = key
        self._epoch_key = epoch_key
        self._transient = transient

    def load(self) -> SavedPosition | None:
        try:
            raw = self._client.hgetall(self._key)
        except self._transient as exc:
            raise LogUnavailable(f"redis unavailable: {exc}") from exc
        if not raw:
            return None
        fields = {_text(k): _text(v) for k, v in raw.items()}
        try:
            offset = int(fields.pop("offset"))
            seqs = {k[4:]: int(v) for k, v in fields.items() if k.startswith("seq:")}
            bases = {k[5:]: int(v) for k, v in fields.items() if k.startswith("base:")}
        except (KeyError, ValueError):
            return None  # unreadable: behave as a fresh bridge rather than guess
        return SavedPosition(offset, seqs, fields.get("epoch", ""), bases)

    @property
    def epoch_key(self) -> str:
        """``LogKeys.epoch`` ("" when this store reads no epoch)."""
        return self._epoch_key

    def log_epoch(self) -> str | None:
        """The log's current epoch (``LogKeys.epoch``); None when there is none."""
        if not self._epoch_key:
            return None
        try:
            raw = self._client.get(self._epoch_key)
        except self._transient as exc:
            raise LogUnavailable(f"redis unavailable: {exc}") from exc
        return None if raw is None else _text(raw)

    def save(self, position: SavedPosition) -> None:
        mapping: dict[str, str] = {"offset": str(position.offset), "epoch": position.epoch}
        mapping.update({f"seq:{t}": str(s) for t, s in position.next_seqs.items()})
        mapping.update({f"base:{t}": str(s) for t, s in position.base_seqs.items()})
        try:
            self._client.hset(self._key, mapping=mapping)
        except self._transient as exc:
            raise LogUnavailable(f"redis unavailable: {exc}") from exc


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
