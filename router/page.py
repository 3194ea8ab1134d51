"""The fleet page: a live view of the router's engines and routing decisions (DESIGN.md 3.9).

:func:`page_routes` serves a self-contained HTML page (inline CSS and JS, nothing fetched from
the network but this router's own ``api/fleet``) and that JSON endpoint. The router mounts it and
provides ``status()``, which returns the fleet in the shape of :data:`FLEET_SHAPE`. The page polls
the endpoint (once a second by default, ``?interval_ms=N`` to change it) and shows, per engine,
health, load, GPU- and CPU-tier blocks and the prompt tokens served from each tier; the recent
routing decisions with predicted against reported cached tokens; and the event rate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.resources import files
from typing import Any, Final

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse

log = logging.getLogger(__name__)

FleetStatus = dict[str, Any]

FLEET_SHAPE: Final = """\
{"policy": str, "event_rate": float,
 "engines": [{"name", "url", "healthy": bool, "in_flight": int, "gpu_blocks": int,
              "cpu_blocks": int, "requests": int, "cached_tokens": int, "prompt_tokens": int,
              "gpu_hit_tokens": int, "cpu_hit_tokens": int}],
 "decisions": [{"t": float (epoch s), "request_id", "engine", "reason",
                "predicted_cached_tokens": int, "cached_tokens": int | null}]}"""

_NO_STORE: Final = {"Cache-Control": "no-store"}


def page_html() -> str:
    """The page, as shipped in router/static (package data)."""
    return files("router").joinpath("static/fleet.html").read_text(encoding="utf-8")


def page_routes(status: Callable[[], FleetStatus]) -> APIRouter:
    """Routes for ``/`` (the page) and ``/api/fleet`` (``status()`` as JSON).

    ``status`` is called on the event loop for each poll, so it must be quick and not block;
    an exception in it answers 503 with ``{"error": {"message", "type"}}`` and the page shows
    the message until a poll succeeds again.
    """
    html = page_html()
    router = APIRouter()

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(html, headers=_NO_STORE)

    @router.get("/api/fleet", summary="the fleet the page shows", description=FLEET_SHAPE)
    async def fleet() -> JSONResponse:
        try:
            body = status()
        except Exception as exc:  # the page must survive a failing status source
            log.exception("fleet status failed")
            error = {"message": f"fleet status unavailable: {exc}", "type": "unavailable"}
            return JSONResponse({"error": error}, status_code=503, headers=_NO_STORE)
        return JSONResponse(body, headers=_NO_STORE)

    return router
