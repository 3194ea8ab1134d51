"""Where a bridge stopped publishing, saved in Redis so a restart continues without a gap.

The hash ``LogKeys.bridge(name)`` holds ``offset`` (the last log offset published) and, per
published topic, ``seq:{topic}`` (the next seq of that stream). Both are written in one HSET, so
they always agree, with ``epoch`` (the log epoch those offsets belong to, DESIGN 3.5) and, per
topic, ``base:{topic}`` (the seq of the epoch's first record: seqs continue across epochs, so
after one they no longer start at 0). Seqs are derived from the log at start anyway (bridge.seqindex); the saved
values matter when old records were trimmed from the log, and to resume at the right offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from events.logreader import LogUnavailable


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
