"""A FastAPI app served by a real uvicorn on a free loopback port, on a thread, for page tests."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from tests.support.redis_proc import free_port


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """Serve ``app``; yields its base URL (ending in '/') once it answers; stops it after."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 15
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        urllib.request.urlopen(base, timeout=5).close()
        yield base
    finally:
        server.should_exit = True
        thread.join(10)
