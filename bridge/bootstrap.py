"""Where a bridge's state starts when the log no longer starts at offset 1: the daemon's
checkpoints (events.checkpoint, DESIGN.md 3.5), read from Redis here.

The bridge's state at a log position P is a checkpoint at O <= P plus the records O+1..P; a
position before every usable checkpoint takes the newest one instead (bridge.publisher).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from events.checkpoint import Manifest, candidates
from events.logkeys import LogKeys
from events.logreader import LogUnavailable
from events.state import Snapshot

log = logging.getLogger("kvbridge")


class KeysClient(Protocol):
    def mget(self, keys: Any, *args: Any) -> Any: ...


class CheckpointReader:
    """The usable checkpoints of one namespace, newest first; Redis errors -> LogUnavailable."""

    def __init__(
        self, client: KeysClient, keys: LogKeys, transient: tuple[type[BaseException], ...] = (OSError,),
    ) -> None:
        self._client = client
        self._keys = keys
        self._transient = transient

    def usable(self, epoch: str | None, first_offset: int) -> list[tuple[Manifest, Snapshot]]:
        """Each checkpoint that verifies, is of ``epoch`` and whose tail the log still holds
        (its oldest record is ``first_offset``); the others are logged and left out."""
        out = []
        for c in candidates(self._keys, self._mget, epoch, first_offset):
            if c.manifest is None or c.snapshot is None:
                log.error("checkpoint %s is unusable (%s); trying an older one", c.ckpt_id, c.problem)
            else:
                out.append((c.manifest, c.snapshot))
        return out

    def _mget(self, keys: list[str]) -> list[Any]:
        try:
            return list(self._client.mget(keys))
        except self._transient as exc:
            raise LogUnavailable(f"redis unavailable: {exc}") from exc
