"""kv-router's HTTP front door (FastAPI): the OpenAI API in front of the engines, /health,
/metrics, the router's status as JSON at /status, and the fleet page (router.page) when present.
The gRPC Generate front door (router.grpc_front) starts and stops with it."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from router.metrics import RouterCollector
from router.service import Router
from rpc.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    install_error_handlers,
    models_list,
    parse_body,
)

log = logging.getLogger("kv-router")


def status(router: Router) -> dict[str, Any]:
    """What the fleet page shows (router.page's ``/api/fleet``)."""
    counts: dict[tuple[str, str], int] = {}
    if router.follower is not None:
        with router.follower.reading() as state:
            if state is not None:
                for (source, medium, _group), n in state.counts().items():
                    counts[(source, medium)] = counts.get((source, medium), 0) + n
    engines = [{
        "name": e.name, "url": e.spec.url, "healthy": e.healthy, "in_flight": e.in_flight,
        "gpu_blocks": counts.get((e.spec.source, "GPU"), 0),
        "cpu_blocks": counts.get((e.spec.node_source, "CPU"), 0),
        "requests": e.requests, "cached_tokens": e.gpu_hit_tokens + e.cpu_hit_tokens,
        "prompt_tokens": e.prompt_tokens, "gpu_hit_tokens": e.gpu_hit_tokens,
        "cpu_hit_tokens": e.cpu_hit_tokens,
    } for e in router.fleet.engines]
    decisions = [{k: d[k] for k in ("t", "request_id", "engine", "reason", "predicted_cached_tokens",
                                    "cached_tokens")} for d in router.truth.decisions]
    return {"policy": router.config.policy,
            "event_rate": router.follower.event_rate() if router.follower is not None else 0.0,
            "engines": engines, "decisions": decisions}


def create_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await router.fleet.check_all()  # engines up now are in rotation before the first request
        task = asyncio.create_task(router.fleet.run_health_checks())
        grpc_front = None
        if router.config.grpc_port >= 0:
            from router.grpc_front import start_grpc

            grpc_front = await start_grpc(router, router.config.host, router.config.grpc_port)
        try:
            yield
        finally:
            task.cancel()
            if grpc_front is not None:
                await grpc_front[0].stop(5)
                await grpc_front[1].close()
            await router.client.aclose()
            router.close()

    app = FastAPI(title="kv-router", summary="KV-aware router with an OpenAI-compatible API",
                  docs_url=None, redoc_url=None, lifespan=lifespan)
    install_error_handlers(app)
    registry = CollectorRegistry()
    registry.register(RouterCollector(router))
    model = router.config.served_model_name

    @app.get("/health")
    def health() -> Response:
        up = [e.name for e in router.fleet.healthy()]
        view = router.follower is None or router.follower.is_ready
        body = {"status": "ok" if up else "unavailable", "engines_in_rotation": up,
                "cache_view": "following" if router.follower and view else ("none" if not router.follower else "starting")}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    def get_status() -> dict[str, Any]:
        return status(router)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return models_list([model])

    async def forward(request: Request, path: str, kind: type[CompletionRequest] | type[ChatCompletionRequest]) -> Response:
        raw = await request.body()
        req = parse_body(kind, raw)
        if req.model is not None and req.model != model:
            raise OpenAIError(404, f"the model {req.model!r} does not exist; this router serves {model!r}",
                              "not_found_error", "model", "model_not_found")
        return await router.route(path, json.loads(raw), req)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions", CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions", ChatCompletionRequest)

    _mount_page(app, lambda: status(router))
    return app


def _mount_page(app: FastAPI, get_status: Callable[[], dict[str, Any]]) -> None:
    """The fleet page lives in router.page (its own owner); served when it is installed."""
    try:
        page = importlib.import_module("router.page")
    except ModuleNotFoundError as exc:
        if exc.name != "router.page":
            raise
        return
    app.include_router(page.page_routes(get_status))
