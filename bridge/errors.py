"""The bridge's errors, under one root (its own module so every bridge module can share it)."""

from __future__ import annotations


class BridgeError(Exception):
    """Base of every error the bridge raises itself."""


class BridgeConfigError(BridgeError, ValueError):
    """A flag or KVB_* value the bridge cannot run with; the message names it."""


class SeqIndexError(BridgeError, ValueError):
    """A seq the index does not hold, or an offset that would break its order."""


class PeerGone(BridgeError):
    """A replay client stopped reading; its reply is abandoned, the service goes on."""


class ForeignEntry(BridgeError):
    """A log entry the daemon did not write: the bridge holds before it (never skips it)."""

    def __init__(self, offset: int) -> None:
        super().__init__(f"log entry {offset} is not a record the daemon wrote")
        self.offset = offset
