"""What an engine answers cannot break the router: usage in another shape (or garbage) is read
as no cached tokens, and the engine's answer still reaches the client, whole or streamed. The
engine here is a real HTTP server that answers what the test says."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from router.config import EngineSpec, RouterConfig
from router.service import Router
from rpc.http_server import ThreadedHttpServer
from rpc.openai_protocol import (
    SSE_DONE,
    CompletionRequest,
    cached_from_usage,
    parse_body,
    sse,
    usage,
)

ODD_USAGES: list[Any] = [
    {"prompt_tokens": "12", "prompt_tokens_details": ["cached_tokens", 4]},
    {"prompt_tokens": [1], "prompt_tokens_details": {"cached_tokens": "many", "gpu_cached_tokens": True}},
    "usage",
]


class Engine:
    """/health ok; /v1/completions answers ``self.usage`` as its usage, whole or as SSE."""

    def __init__(self) -> None:
        self.usage: Any = None
        self.health: dict[str, Any] = {"status": "ok"}
        app = FastAPI()
        app.get("/health")(lambda: self.health)

        @app.post("/v1/completions")
        async def completions(body: dict[str, Any]) -> Response:
            if body.get("stream"):
                text = sse({"choices": [{"index": 0, "text": "hi", "finish_reason": "length"}]})
                tail = sse({"choices": [], "usage": self.usage})
                return Response(text + tail + SSE_DONE, media_type="text/event-stream")
            return JSONResponse({"choices": [{"index": 0, "text": "hi"}], "usage": self.usage})

        self.http = ThreadedHttpServer(app).start()
        self.url = f"http://127.0.0.1:{self.http.port}"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    e = Engine()
    yield e
    e.http.stop()


def _route(engine: Engine, body: dict[str, Any]) -> tuple[int, bytes, Router]:
    async def go() -> tuple[int, bytes, Router]:
        async with httpx2.AsyncClient(trust_env=False) as client:
            router = Router(RouterConfig(engines=(EngineSpec("e", engine.url),), block_size=4), client, None)
            await router.fleet.check_all()
            req = parse_body(CompletionRequest, json.dumps(body).encode())
            resp = await router.route("/v1/completions", body, req)
            if hasattr(resp, "body_iterator"):
                content = b"".join([c if isinstance(c, bytes) else c.encode() async for c in resp.body_iterator])
            else:
                content = bytes(resp.body)
            return resp.status_code, content, router

    return asyncio.run(go())


@pytest.mark.parametrize("odd", ODD_USAGES)
def test_odd_usage_is_read_as_nothing_cached(engine: Engine, odd: Any) -> None:
    engine.usage = odd
    status, content, router = _route(engine, {"prompt": "hello there router", "max_tokens": 1})
    assert status == 200 and json.loads(content)["usage"] == odd
    e = router.fleet.by_name["e"]
    assert e.in_flight == 0 and e.healthy
    status, content, router = _route(engine, {"prompt": "hello there router", "max_tokens": 1, "stream": True,
                                              "stream_options": {"include_usage": True}})
    assert status == 200 and b'"text":"hi"' in content and content.endswith(SSE_DONE)
    assert router.fleet.by_name["e"].in_flight == 0


@pytest.mark.parametrize(("gpu_blocks", "pool"), [(128, 128), ("128", 0), (-5, 0), (True, 0), (None, 0)])
def test_the_pool_size_for_the_pressure_model_comes_from_health(engine: Engine, gpu_blocks: Any, pool: int) -> None:
    """Our engines report their pool; another engine's /health (or a garbled one) turns the
    pressure model off for it, and requests still go through."""
    engine.health = {"status": "ok", "gpu_blocks": gpu_blocks}
    engine.usage = usage(18, 1, 8, 0)
    try:
        status, _content, router = _route(engine, {"prompt": "hello there router, " * 4, "max_tokens": 1})
    finally:
        engine.health = {"status": "ok"}
    e = router.fleet.by_name["e"]
    assert status == 200 and e.pressure.pool_blocks == pool and e.in_flight == 0


def test_well_formed_usage_is_counted(engine: Engine) -> None:
    engine.usage = usage(18, 1, 8, 4)
    _status, _content, router = _route(engine, {"prompt": "hello there router", "max_tokens": 1})
    e = router.fleet.by_name["e"]
    assert (e.requests, e.prompt_tokens, e.gpu_hit_tokens, e.cpu_hit_tokens) == (1, 18, 8, 4)
    assert cached_from_usage({"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 5}}}) == (9, 5, 0)
    assert cached_from_usage({"usage": ODD_USAGES[0]}) == (0, 0, 0) and cached_from_usage({"x": 1}) is None
