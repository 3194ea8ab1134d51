"""Domain errors of the daemon; the servicers map each class to one gRPC status code."""

from __future__ import annotations


class OffloadError(Exception):
    """Root of the daemon's request errors; the message is shown to the caller."""


class InvalidArgument(OffloadError):
    """Malformed input: wrong hash sizes, unknown groups, bad token counts, garbage."""


class FailedPrecondition(OffloadError):
    """Well-formed but not acceptable now: unregistered engine, unknown or expired lease."""


class NotFound(OffloadError):
    """A block asked for by hash is not resident."""


class ResourceExhausted(OffloadError):
    """Nothing could be reserved: no free slot and nothing evictable."""
