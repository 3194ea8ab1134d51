"""kv-ingest's errors, under one root."""

from __future__ import annotations


class IngestError(Exception):
    """Root of kv-ingest's errors."""


class IngestConfigError(IngestError, ValueError):
    """A flag, environment value or config file that kv-ingest cannot use; the message says which."""


class Garbage(IngestError):
    """A frame or payload from a publisher that does not follow the wire; ``kind`` groups them
    for the counters and the once-per-kind log line."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
