"""events.replay_socket against a real ROUTER socket: an answer read to its end marker, a
refusal, and a late answer that must not be taken for the next request's; an endpoint ZMQ
refuses is one clear error for the subscriber and the processes that take one."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import zmq

from events.replay_socket import Batch, EndpointError, ReplaySocket, SubscriberError
from events.subscriber import KvEventSubscriber
from events.wire_frames import END_SEQ, SNAPSHOT, ReplayRequest, parse_request, seq_bytes
from kvctl.main import main as kvctl_main
from router.main import main as router_main


class Bridge:
    """A ROUTER on a free port, answering by hand; requests are made from a worker thread."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.client = ReplaySocket(self.ctx, f"tcp://127.0.0.1:{port}", timeout_s=0.5)
        self.pool = ThreadPoolExecutor(1)

    def ask(self, body: bytes) -> Future[tuple[list[Batch], bytes]]:
        return self.pool.submit(self.client.request, body)

    def received(self) -> ReplayRequest:
        return parse_request(self.sock.recv_multipart())

    def answer(self, identity: bytes, seqs: list[int], end: bytes = END_SEQ, end_topic: bytes = b"") -> None:
        for seq in seqs:
            self.sock.send_multipart([identity, b"", b"t", seq_bytes(seq), f"batch {seq}".encode()])
        self.sock.send_multipart([identity, b"", end_topic, end, b""])

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def bridge() -> Iterator[Bridge]:
    b = Bridge()
    yield b
    b.close()


def test_an_answer_is_read_to_its_end_marker(bridge: Bridge) -> None:
    reply = bridge.ask(seq_bytes(5))
    req = bridge.received()
    assert req.start_seq == 5
    bridge.answer(req.identity, [5, 6])
    assert reply.result(5) == ([(b"t", seq_bytes(5), b"batch 5"), (b"t", seq_bytes(6), b"batch 6")], END_SEQ)
    reply = bridge.ask(SNAPSHOT)
    req = bridge.received()
    assert req.start_seq is None
    bridge.answer(req.identity, [0], end=seq_bytes(42))
    assert reply.result(5)[1] == seq_bytes(42)


def test_a_refusal_is_an_error_naming_it(bridge: Bridge) -> None:
    reply = bridge.ask(seq_bytes(0))
    bridge.answer(bridge.received().identity, [], end_topic=b"error: no stream 'x'")
    with pytest.raises(SubscriberError, match="error: no stream 'x'"):
        reply.result(5)


def test_a_late_answer_is_not_taken_for_the_next_ones(bridge: Bridge) -> None:
    reply = bridge.ask(seq_bytes(1))
    first = bridge.received()
    with pytest.raises(SubscriberError, match="no complete reply"):
        reply.result(5)
    bridge.answer(first.identity, [1, 2, 3])  # too late: to the socket that was replaced
    reply = bridge.ask(seq_bytes(7))
    second = bridge.received()
    assert second.identity != first.identity and second.start_seq == 7
    bridge.answer(second.identity, [7])
    assert reply.result(5) == ([(b"t", seq_bytes(7), b"batch 7")], END_SEQ)


@pytest.mark.parametrize("pub, replay", [("garbage", "tcp://127.0.0.1:1"), ("tcp://127.0.0.1:1", "127.0.0.1:2")])
def test_a_bad_endpoint_is_one_clear_error(pub: str, replay: str, capsys: pytest.CaptureFixture[str]) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with pytest.raises(EndpointError, match=r"cannot connect to .*expected tcp://HOST:PORT"):
        KvEventSubscriber(pub, replay, "t", ctx=ctx)
    ctx.term()  # returns at once: the subscriber closed the sockets it had opened
    assert kvctl_main(["tail", "--pub", pub, "--replay", replay, "--count", "1"]) == 2
    assert router_main(["--engine", "e=http://127.0.0.1:1", "--port", "0", "--grpc-port", "-1",
                        "--bridge-pub", pub, "--bridge-replay", replay]) == 2
    err = capsys.readouterr().err
    assert err.count("cannot connect to") == 2 and "Traceback" not in err
