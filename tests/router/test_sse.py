"""The router's reading of engine SSE streams: events split across network chunks, which events
end the retry window (a token, a finish, an error) and which chunk is the usage one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from router.sse import SseEvent, sse_events
from rpc.openai_protocol import SSE_DONE, sse, usage


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def _read(data: bytes, size: int) -> list[SseEvent]:
    async def collect() -> list[SseEvent]:
        return [ev async for ev in sse_events(_chunks(data, size))]

    return asyncio.run(collect())


ROLE = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
TOKEN = sse({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None}]})
TEXT = sse({"choices": [{"index": 0, "text": "hi", "finish_reason": None}]})
USAGE = sse({"choices": [], "usage": usage(10, 2, 8, 0)})
STREAM = ROLE + TOKEN + TEXT + USAGE + SSE_DONE


def test_events_survive_any_chunking() -> None:
    for size in (1, 3, 7, 64, len(STREAM)):
        events = _read(STREAM, size)
        assert b"".join(ev.raw for ev in events) == STREAM
        assert len(events) == 5 and events[-1].data is None


def test_what_ends_the_retry_window() -> None:
    role, token, text, use, done = _read(STREAM, 5)
    assert not role.carries_output  # sent before the prefill: the engine may still die
    assert token.carries_output and text.carries_output  # a token was generated
    assert not use.carries_output and use.is_usage_only and not text.is_usage_only
    assert done.carries_output
    assert _read(sse({"error": {"message": "x"}}), 4)[0].carries_output
    garbage = _read(b"data: {not json\n\n", 4)[0]
    assert garbage.data is None and not garbage.carries_output


def test_chunks_of_another_shape_carry_no_output() -> None:
    for data in ({"choices": "text"}, {"choices": ["x", 1, None]}, {"choices": {"0": {"text": "a"}}}, [1, 2]):
        ev = _read(sse(data) if isinstance(data, dict) else b"data: [1, 2]\n\n", 3)[0]
        assert not ev.carries_output and not ev.is_usage_only
