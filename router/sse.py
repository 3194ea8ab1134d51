"""Server-sent events as the engines stream them (``data: <json>`` blocks, ``data: [DONE]``),
read by the router as they pass through it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SseEvent:
    raw: bytes
    """The event as received, with its blank-line end."""
    data: Any
    """The decoded JSON of its data line; None for [DONE] or anything that is not JSON."""

    @property
    def is_usage_only(self) -> bool:
        """The chunk an engine adds for stream_options.include_usage (no choices)."""
        return isinstance(self.data, dict) and self.data.get("choices") == [] and "usage" in self.data

    @property
    def carries_output(self) -> bool:
        """A generated token (a completion chunk, a chat delta other than the opening role),
        a finish reason or an error: once one went to the client, no retry elsewhere."""
        d = self.data
        if not isinstance(d, dict):
            return self.raw.startswith(b"data: [DONE]")
        if "error" in d:
            return True
        choices = d.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue  # another server's idea of a chunk: nothing we can call output
            delta = choice.get("delta")
            if choice.get("finish_reason") or "text" in choice or (isinstance(delta, dict) and "role" not in delta):
                return True
        return False


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[SseEvent]:
    buf = b""
    async for chunk in chunks:
        buf += chunk
        while True:
            end = buf.find(b"\n\n")
            if end < 0:
                break
            raw, buf = buf[: end + 2], buf[end + 2 :]
            yield SseEvent(raw, _decode(raw))
    if buf.strip():
        yield SseEvent(buf + b"\n\n", _decode(buf))


def _decode(raw: bytes) -> Any:
    for line in raw.splitlines():
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return None
            try:
                return json.loads(payload)
            except ValueError:
                return None
    return None
