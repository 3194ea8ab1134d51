"""Client channels come back quickly after their server was down for a while.

gRPC's default backoff (1 s growing 1.6x to 120 s) made an engine notice a daemon that had been
down for a minute only minutes later; rpc.tls caps it at 2 s for every channel we open."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rpc.tls import ClientSecurity
from tests.support.redis_proc import free_port


def _serve(port: int) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


def _check(channel: grpc.Channel) -> bool:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.5, wait_for_ready=True)
        return True
    except grpc.RpcError:
        return False


def test_a_channel_reconnects_within_two_seconds_after_a_long_outage() -> None:
    port = free_port()
    channel = ClientSecurity().channel(f"127.0.0.1:{port}")
    try:
        # Down for 20 s while the client keeps trying: uncapped, its tries would come at about
        # 0, 1, 2.6, 5.2, 9.3, 15.8 and 26.3 s (1.6x, +-20% jitter), ~6 s after the server is back.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert not _check(channel)
            time.sleep(0.2)
        server = _serve(port)
        try:
            back = time.monotonic()
            # A call that waits for the channel (as a client waiting for its daemon) goes out on
            # the channel's next reconnect attempt: within the 2 s cap, not the grown backoff.
            while not _check(channel):
                assert time.monotonic() - back < 3.5, "the channel did not reconnect within its 2 s cap"
                time.sleep(0.05)
        finally:
            server.stop(None)
    finally:
        channel.close()


def test_a_callers_own_backoff_option_wins() -> None:
    from rpc.tls import _with_reconnect

    opts = _with_reconnect([("grpc.max_reconnect_backoff_ms", 50), ("grpc.max_receive_message_length", 1)])
    assert dict(opts) == {"grpc.initial_reconnect_backoff_ms": 250, "grpc.max_reconnect_backoff_ms": 50,
                          "grpc.max_receive_message_length": 1}
    assert len(opts) == 3
