"""The root of every error the events library raises.

A caller that embeds the library (a router, a tool) can catch :class:`EventsError` for all of
them; each concrete error keeps its own module and its standard base (``SchemaError`` and
``BadRequest`` are ``ValueError`` too) so that existing handlers keep matching.
"""

from __future__ import annotations


class EventsError(Exception):
    """Base of the events library's errors: SchemaError, LogUnavailable, SubscriberError,
    BadRequest."""
