"""Errors of the offloadd package, under one root: :class:`OffloaddError`.

- :class:`RequestError` and its subclasses are the daemon's domain errors: raised by the host
  tier and the log, mapped by the servicer (offloadd.edge.service) to one gRPC status each.
- The client's errors (offloadd.client.errors) derive from the same root, so a caller can catch
  everything this package raises with one ``except OffloaddError``.
"""

from __future__ import annotations


class OffloaddError(Exception):
    """Root of every error the offloadd package raises on purpose."""


class RequestError(OffloaddError):
    """Root of the daemon's request errors; the message is shown to the caller."""


class InvalidArgument(RequestError):
    """Malformed input: wrong hash sizes, unknown groups, bad token counts, garbage."""


class FailedPrecondition(RequestError):
    """Well-formed but not acceptable now: unregistered engine, unknown or expired lease."""


class NotRegistered(FailedPrecondition):
    """The engine id is not registered (never was, or the daemon forgot it with a new arena):
    the engine must call RegisterEngine again. Marked on the wire so clients can tell it apart."""


class NotFound(RequestError):
    """A block asked for by hash is not resident."""


class ResourceExhausted(RequestError):
    """Nothing could be reserved: no free slot and nothing evictable."""


class NamespaceOwned(OffloaddError):
    """Another live daemon holds the namespace's owner lease: this one must not start."""


class ForeignData(OffloaddError):
    """A key or log entry of the namespace holds what the daemon did not write (wrong type,
    undecodable value, an entry that is not a record); the message names it and the repair."""
