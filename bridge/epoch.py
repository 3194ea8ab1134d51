"""The signal a bridge publishes when the log it follows is replaced by a new one.

The log has an identity, its epoch (``LogKeys.epoch``, DESIGN 3.5). When Redis loses the log,
the daemon starts a new one under a new epoch, with offsets from 1 again. The bridge then
publishes, on every stream and with the stream's seq continuing (never reset, never skipped):

1. one batch per source it knew (one source-less batch when it knew none), each holding a single
   ``AllBlocksCleared`` with no medium: "everything of this source is gone" (a vLLM consumer,
   which has no notion of sources, forgets everything);
2. then the new log's records from offset 1.

Replay requests for seqs from before the change answer with the same clear batches and the new
log from its start: the subscriber sees the jump. Until it has published the new log up to the
head it found, ``/healthz`` answers 503 with the reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Literal

from bridge.metrics import Health
from events.codec_vllm import encode_batch
from events.schema import AllBlocksCleared

log = logging.getLogger("kvbridge")

Preamble = tuple[tuple[int, bytes], ...]
"""``(seq, payload)`` of the clear batches that open an epoch on one stream."""


def clear_batches(
    sources: Sequence[str], first_seq: int, layout: Literal["map", "legacy"]
) -> Preamble:
    """The clear batches of a new epoch, numbered from ``first_seq``."""
    ts = time.time()
    targets: Sequence[str | None] = list(sources) or [None]
    return tuple(
        (first_seq + i, encode_batch(
            (AllBlocksCleared(),), ts, layout=layout, source=src if layout == "map" else None,
        ))
        for i, src in enumerate(targets)
    )


class EpochWatch:
    """Which log epoch the bridge publishes, and whether it is re-syncing (``/healthz`` 503).

    ``read_epoch`` reads ``LogKeys.epoch`` (None when absent); ``head`` the log's head offset.
    """

    def __init__(
        self, read_epoch: Callable[[], str | None], head: Callable[[], int], health: Health,
        check_s: float,
    ) -> None:
        self.epoch: str | None = None  # of the log being published; None: none seen
        self.is_gone = False  # the epoch vanished: the log was lost, a new one is awaited
        self.detail = ""  # what /healthz says while re-syncing ("" when not)
        self._read_epoch = read_epoch
        self._head = head
        self._health = health
        self._check_s = check_s
        self._until: int | None = None  # re-syncing until published up to this offset
        self._last_check = 0.0

    def is_due(self) -> bool:
        return time.monotonic() - self._last_check >= self._check_s

    def check(self, position: int, moved_back: bool, read: tuple[str | None] | None = None
              ) -> str | None:
        """None while the log is still the one published (or gone, see ``is_gone``); else the
        new epoch, which the caller opens (:meth:`opened`). ``moved_back``: also compare the
        head with ``position`` (a log without epochs that restarted at 1). ``read``: the epoch
        as the caller just read it (bridge.tip), instead of reading it here."""
        self._last_check = time.monotonic()
        current = self._read_epoch() if read is None else read[0]
        if current == self.epoch and not (moved_back and self._head() < position):
            return None
        if current is None and self.epoch is not None:
            if not self.is_gone:
                log.error("the log's epoch %s is gone (Redis lost the log?); waiting for a new log",
                          self.epoch)
            self.is_gone = True
            self._resyncing(f"re-syncing: log epoch {self.epoch} is gone; waiting for a new log")
            return None
        if self.epoch is None and current is not None and not moved_back:
            self.epoch = current  # a log from before epochs was given one: the same records
            return None
        log.warning("log epoch changed from %s to %s (offsets restart at 1): telling subscribers "
                    "and publishing the new log", self.epoch, current)
        return current or ""

    def opened(self, epoch: str, detail: str = "") -> None:
        """The caller published the clear batches of ``epoch`` and restarts at offset 1;
        ``detail``: why, for ``/healthz`` (default: a new epoch)."""
        self.epoch, self.is_gone = epoch, False
        self._until = self._head()
        self._resyncing(detail or f"re-syncing: new log epoch {epoch}, publishing it from offset 1")
        self.published(0)

    def published(self, position: int) -> None:
        """Re-syncing ends once the new log is published up to the head found when it opened."""
        if self._until is not None and position >= self._until:
            self._until, self.detail = None, ""
            log.info("re-synced to log epoch %s (offset %d)", self.epoch, position)
            self._health.set(redis_ok=True, detail=f"publishing after offset {position}", ready=True)

    def _resyncing(self, detail: str) -> None:
        self.detail = detail
        self._health.set(redis_ok=True, detail=detail, ready=False)
