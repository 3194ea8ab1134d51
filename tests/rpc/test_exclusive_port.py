"""Our gRPC servers refuse a port another server already serves (rpc.listen.EXCLUSIVE_PORT)."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from rpc.listen import EXCLUSIVE_PORT, ListenError, add_port
from tests.support.redis_proc import free_port


def _server(options: list[tuple[str, int]]) -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=options)


def test_a_second_server_on_a_served_port_is_refused() -> None:
    port = free_port()
    first = _server([EXCLUSIVE_PORT])
    assert add_port(first, f"127.0.0.1:{port}") == port
    first.start()
    try:
        with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{port}: the port is in use"):
            add_port(_server([EXCLUSIVE_PORT]), f"127.0.0.1:{port}")
        # Why the option: with gRPC's defaults both bind, and the kernel splits the connections.
        port2 = free_port()
        assert add_port(_server([]), f"127.0.0.1:{port2}") == port2
        assert add_port(_server([]), f"127.0.0.1:{port2}") == port2
    finally:
        first.stop(None)

