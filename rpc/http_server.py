"""An ASGI app served by uvicorn on a thread of its own, beside a process's gRPC server.

The socket is bound before the thread starts, so port 0 gives a free port known at once and a
port in use fails in the caller with OSError. ``stop`` lets in-flight requests finish (uvicorn's
graceful shutdown) for up to ``grace_s``.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import uvicorn


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one) for uvicorn to serve on; OSError
    naming the address when it cannot be bound (taken, not this machine's, out of range)."""
    if not 0 <= port <= 65535:
        raise OSError(f"port must be in 0..65535, got {port}")
    bind_host = host.strip("[]") or "::"
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind_host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock


class ThreadedHttpServer:
    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, grace_s: float = 5.0,
                 log_level: str = "warning") -> None:
        self._sock = bind_socket(host, port)
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=False,
                                timeout_graceful_shutdown=int(max(grace_s, 1)))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="http", daemon=True)

    def start(self, timeout_s: float = 10.0) -> ThreadedHttpServer:
        self._thread.start()
        if not _wait(lambda: self._server.started or not self._thread.is_alive(), timeout_s):
            raise OSError(f"HTTP server did not start within {timeout_s}s")
        if not self._server.started:
            raise OSError("HTTP server failed to start (see the log)")
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()


def _wait(done: Any, timeout_s: float) -> bool:
    event = threading.Event()
    deadline = timeout_s
    step = 0.02
    while deadline > 0:
        if done():
            return True
        event.wait(step)
        deadline -= step
    return bool(done())
