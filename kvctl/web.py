"""``kvctl web LOG``: a recorded log in the browser, with a time slider.

The log (a file from ``kvctl record``, or the Redis log as it is when the command starts) is read
once into a :class:`kvctl.seek.SeekableLog`; a page served on 127.0.0.1 shows the state at the
slider's offset (per source and tier: blocks, chains) and the difference between two offsets.
The page is one self-contained file (kvctl/static/web.html: no network at run time) over three
JSON endpoints, each computed by the one reducer:

- ``GET /api/log``: offsets, time span, sources, resident blocks per tier along the log;
- ``GET /api/state?at=N[&source=S][&chains=false]``: the state after offset N (with S, that
  source's chains; ``chains=false`` leaves out the chain counts, which cost most at a large state);
- ``GET /api/diff?a=A&b=B``: blocks added and removed per tier from A to B.

Errors answer 400 with ``{"error": {"message", "type"}}``.
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
import socket
import sys
from importlib.resources import files
from typing import TYPE_CHECKING, Any

from kvctl.errors import KvctlError
from kvctl.logsource import add_source_args, is_redis, open_log
from kvctl.seek import SeekableLog
from rpc.logs import redact_url

if TYPE_CHECKING:
    from fastapi import FastAPI

DEFAULT_PORT = 8710


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "web",
        help="browse a recorded log with a time slider (state at any offset, diffs)",
        description="Load the log, then serve a page with a time slider: the state at any "
        "offset (blocks and chains per source and tier), the record that led to it, and the "
        "blocks added and removed between two offsets. A Redis log is read as it is at start. "
        "Ctrl-C or SIGTERM stops it.",
    )
    add_source_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port to listen on (default {DEFAULT_PORT}; 0 = any free port)")
    p.add_argument("--keep-every", type=int, metavar="N",
                   help="keep a copy of the state every N records, so a jump replays at most N "
                   "(default: when applying the records since the last copy took 4x what that copy did)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise KvctlError(f"--port must be in 0..65535, got {args.port}")
    if args.keep_every is not None and args.keep_every <= 0:
        raise KvctlError(f"--keep-every must be > 0, got {args.keep_every}")
    view = open_log(args, label="loading")
    seekable = SeekableLog(view.state(), view.records, args.keep_every)
    name = redact_url(args.log) if is_redis(args.log) else args.log  # shown: no password
    if not seekable.records and seekable.start == 0:
        raise KvctlError(f"the log is empty: nothing to show ({name})")
    sock = _listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    span = f"offsets {seekable.start}..{seekable.last}" + (f", {view.note}" if view.note else "")
    print(f"kvctl: {name}: {len(seekable.records)} records ({span})")
    print(f"kvctl: serving http://{shown}:{port}/ (Ctrl-C stops)", flush=True)
    if not ipaddress.ip_address(host).is_loopback:
        print(f"kvctl: warning: {host} is reachable from other machines and the page has no "
              "authentication: anyone who reaches it reads the log's sources and hashes",
              file=sys.stderr)
    serve(build_app(seekable, name), sock)
    return 0


def _listen(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        raise KvctlError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def serve(app: FastAPI, sock: socket.socket) -> None:
    """Serve until Ctrl-C or SIGTERM; uvicorn's handlers let in-flight requests finish."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False)
    # After a graceful stop uvicorn raises the signal it caught again, for the handler it
    # replaced: SIGTERM's is a no-op here, so a stopped kvctl web exits 0 (Ctrl-C: 130).
    previous = signal.signal(signal.SIGTERM, lambda _sig, _frame: None)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)


def build_app(seekable: SeekableLog, name: str) -> FastAPI:
    """The page and its JSON endpoints over ``seekable``."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    page = files("kvctl").joinpath("static/web.html").read_text(encoding="utf-8")
    app = FastAPI(title=f"kvctl web: {name}", docs_url=None, redoc_url=None)

    def error(message: str, status: int = 400) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}},
                            status_code=status)

    @app.exception_handler(KvctlError)
    async def refused(_req: Request, exc: KvctlError) -> JSONResponse:
        return error(str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in exc.errors()]
        return error("; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        # an unknown path or method: the same error shape as the API's own errors
        return error(str(exc.detail), exc.status_code)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/api/log")
    async def log_summary() -> dict[str, Any]:
        return {"name": name, **seekable.summary()}

    @app.get("/api/state")
    def state(at: int, source: str | None = None, chains: bool = True) -> dict[str, Any]:
        return seekable.state_json(at, source, chains)

    @app.get("/api/diff")
    def diff(a: int, b: int) -> dict[str, Any]:
        return seekable.diff_json(a, b)

    return app
