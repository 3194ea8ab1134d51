"""The block port (``--fleet-block-port``): a peer's blocks sent with sendfile over a raw TCP
socket. Node b reads a's chain through it (peer given as ``...@PORT``) and serves it as its own
CPU-tier hit; the port refuses a wrong token, a block that is not resident and garbage with an
error frame, and the daemon carries on."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import grpc
import pytest

from offloadd.client import GroupQuery, OffloadClient, OffloadClientError
from offloadd.fleet.block_reader import read_blocks_raw
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_proc import free_port
from tests.support.synthetic_engine import GROUP, SLOT, SyntheticStorer, digest, served_blocks_match

CHAIN = 40


def _chain_on(a: DaemonProcess) -> list[bytes]:
    storer = SyntheticStorer(a.target, "raw", chain_len=CHAIN, max_chains=1).start()
    deadline = time.monotonic() + 20
    while storer.stats.stores < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    storer.stop()
    assert storer.stats.stores == 1
    return [digest("raw", i) for i in range(CHAIN)]


def test_b_reads_a_chain_through_the_block_port(tmp_path: Path, redis_url: str) -> None:
    port = free_port()
    a = DaemonProcess(tmp_path / "a", redis_url, "node-a", capacity_bytes=4 * CHAIN * SLOT,
                      extra_args=("--fleet-block-port", str(port)))
    a.start()
    b = DaemonProcess(tmp_path / "b", redis_url, "node-b", capacity_bytes=4 * CHAIN * SLOT,
                      extra_args=("--fleet-peers", f"a={a.target}/node-a@{port}",
                                  "--fleet-refresh-ms", "50"))
    b.start()
    try:
        chain = _chain_on(a)
        with OffloadClient(b.target) as local:
            arena = local.register_engine("b-eng", 1, "synthetic", [GROUP]).map_arena(0)
            try:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    got = local.lookup("b-eng", [GroupQuery(0, tuple(chain))]).results[0].num_prefix
                    if got == CHAIN:
                        break
                    time.sleep(0.05)
                assert got == CHAIN
                assert served_blocks_match(local, "b-eng", arena, chain) == (CHAIN, [])
            finally:
                arena.close()
        assert "fleet fill: 40 blocks from a" in b.log_path.read_text()
    finally:
        a.kill()
        b.kill()


def test_the_block_port_refuses_what_it_should(tmp_path: Path, redis_url: str) -> None:
    port = free_port()
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    token_file.chmod(0o600)
    a = DaemonProcess(tmp_path / "a", redis_url, "node-a", capacity_bytes=4 * CHAIN * SLOT,
                      extra_args=("--fleet-block-port", str(port), "--auth-token-file", str(token_file)))
    a.start()
    try:
        with OffloadClient(a.target, token="s3cret") as peer:
            storer_chain = [digest("none", i) for i in range(2)]
            peer.register_engine("reader", 1, "synthetic", [GROUP])
        address = ("127.0.0.1", port)
        with pytest.raises(OffloadClientError, match="UNAUTHENTICATED"):
            read_blocks_raw(address, "wrong", 2.0, "reader", 0, storer_chain, SLOT)
        with pytest.raises(OffloadClientError, match="not resident"):
            read_blocks_raw(address, "s3cret", 2.0, "reader", 0, storer_chain, SLOT)
        with pytest.raises(OffloadClientError, match=r"not registered|unknown engine"):
            read_blocks_raw(address, "s3cret", 2.0, "nobody", 0, storer_chain, SLOT)
        with socket.create_connection(address, timeout=5) as s:  # garbage: an error frame, closed
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            answer = s.recv(4096)
            assert answer[:4] == b"\xff\xff\xff\xff" and b"not a block-port request" in answer
        with OffloadClient(a.target, token="s3cret") as peer:  # the daemon is fine
            assert peer.stats().num_blocks == 0
        assert a.proc is not None and a.proc.poll() is None
        with grpc.insecure_channel(a.target) as ch:
            grpc.channel_ready_future(ch).result(timeout=5)
    finally:
        a.kill()
