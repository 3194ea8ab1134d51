"""Errors of the log writer (offloadd.log.metadata): how a write to Redis can fail."""

from __future__ import annotations

from offloadd.errors import OffloaddError


class RedisUnavailable(OffloaddError):
    """Redis could not be reached or refused the write; nothing was applied in memory."""


class WriteInDoubt(RedisUnavailable):
    """The write may have landed (its reply was lost, or its replicas did not acknowledge it in
    time): not applied yet, and not reverted either. The writer settles it before its next write
    (offloadd.log.in_doubt): applied if it landed, else reverted then."""


class LogConflict(OffloaddError):
    """The log moved under us (another writer, or a write we gave up on landed late)."""


class OwnershipLost(LogConflict):
    """The namespace's owner lease is no longer ours: another daemon may own it; stop."""


class ForeignEntry(LogConflict):
    """The log or a key the write needs holds what the daemon did not write; nothing written."""


class RecordRefused(OffloaddError):
    """One record of a write group could not be written (its projection raised, or the log
    already holds its position): nothing of it was applied and its ``revert`` ran; the rest of
    the group was written without it."""


class AlreadyLogged(RecordRefused):
    """The log already holds the record's ``(source, incarnation, seq)``, or a later position
    of that source: the write script refused it (DECISIONS 52). ``index`` is its place in the
    write that was refused."""

    def __init__(self, message: str, index: int = -1) -> None:
        super().__init__(message)
        self.index = index
