"""kv-router refuses addresses it cannot serve on in one line, before it starts anything: an
HTTP or gRPC port already taken, a port out of range."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from router.main import main as router_main

ENGINE = ["--engine", "e=http://127.0.0.1:1,grpc=127.0.0.1:2", "--host", "127.0.0.1"]


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_a_taken_port(taken_port: int, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    other = "--grpc-port" if flag == "--port" else "--port"
    assert router_main([*ENGINE, flag, str(taken_port), other, "0"]) == 2
    err = capsys.readouterr().err
    assert err == f"kv-router: error: cannot listen on 127.0.0.1:{taken_port}: Address already in use\n"


def test_a_port_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    assert router_main([*ENGINE, "--port", "70000"]) == 2
    assert capsys.readouterr().err == "kv-router: error: port must be in 0..65535, got 70000\n"
