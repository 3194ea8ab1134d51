"""Where a bridge's state starts when the log no longer starts at offset 1: the daemon's
checkpoints (events.checkpoint, DESIGN.md 3.5), read from Redis here.

The bridge's state at a log position P is a checkpoint at O <= P plus the records O+1..P; a
position before the oldest retained record jumps to the newest checkpoint; a position inside the
retained log but before every checkpoint takes the checkpoint's state once publishing reaches
its offset (bridge.state). Which applies is chosen here, at start (:func:`start_state`) and
after a gap found while running (:func:`defer_state`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from bridge.state import LazyState
from events.checkpoint import Manifest, candidates
from events.logkeys import LogKeys
from events.logreader import LogUnavailable
from events.schema import SchemaError
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


def start_state(checkpoints: CheckpointReader | None, state: LazyState, epoch: str | None,
                resume: int, first: int) -> tuple[int, int]:
    """The state on a log trimmed before ``first`` (module docstring): (the position to
    resume after, the offset through which the state already holds the records)."""
    found = checkpoints.usable(epoch, first) if checkpoints is not None else []
    at_or_before = [c for c in found if c[0].offset <= resume]
    for manifest, snap in at_or_before or found:
        try:
            if manifest.offset <= resume:
                state.start_from(snap)
            elif resume < first - 1:
                log.warning("position %d is before the oldest retained record %d: jumping to the "
                            "checkpoint at offset %d", resume, first, manifest.offset)
                state.start_from(snap)
                resume = manifest.offset
            else:
                state.defer_to(snap)
        except SchemaError as exc:
            log.error("checkpoint %s holds an invalid event (%s); trying an older one",
                      manifest.ckpt_id, exc)
            continue
        log.info("state from checkpoint %s at offset %d", manifest.ckpt_id, manifest.offset)
        return resume, manifest.offset
    log.error("the log starts at offset %d and no usable checkpoint covers the records before "
              "it: snapshots miss the blocks stored before it", first)
    return resume, 0


def defer_state(checkpoints: CheckpointReader | None, state: LazyState, epoch: str | None,
                first: int) -> None:
    """After a gap the state misses the trimmed records: it is the newest usable checkpoint's
    once publishing reaches it (its offset is at least ``first`` - 1: the log holds its tail)."""
    found = checkpoints.usable(epoch, first) if checkpoints is not None else []
    for manifest, snap in found:
        try:
            state.defer_to(snap)
        except SchemaError as exc:
            log.error("checkpoint %s holds an invalid event (%s)", manifest.ckpt_id, exc)
            continue
        log.info("state from checkpoint %s at offset %d after the gap", manifest.ckpt_id, manifest.offset)
        return
    log.error("no usable checkpoint covers the records trimmed before offset %d: snapshots miss "
              "the blocks stored before it", first)
