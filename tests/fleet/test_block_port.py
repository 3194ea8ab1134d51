"""The block port (``--fleet-block-port``): a peer's blocks sent with sendfile over a raw TCP
socket. Node b reads a's chain through it (peer given as ``...@PORT``) and serves it as its own
CPU-tier hit; the port refuses a wrong token, an unknown reader, the old wire and garbage with an
error frame (a block it does not hold ends the prefix it sends), and the daemon carries on. A
transfer cut, corrupted or ended by the peer's SIGKILL keeps the blocks that arrived whole and
intact, and nothing else."""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from offloadd.client import BlockToStore, GroupQuery, OffloadClient, OffloadClientError
from offloadd.fleet.block_reader import read_blocks_raw
from offloadd.fleet.port_fill import COMMIT_BLOCKS
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_proc import free_port
from tests.support.synthetic_engine import (
    GROUP,
    SLOT,
    SyntheticStorer,
    block_bytes,
    digest,
    served_blocks_match,
)

CHAIN = 40


def _chain_on(a: DaemonProcess, n: int = CHAIN) -> list[bytes]:
    storer = SyntheticStorer(a.target, "raw", chain_len=n, max_chains=1).start()
    deadline = time.monotonic() + 20
    while storer.stats.stores < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    storer.stop()
    assert storer.stats.stores == 1
    return [digest("raw", i) for i in range(n)]


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
        assert read_blocks_raw(address, "s3cret", 2.0, "reader", 0, storer_chain, SLOT) == []  # none held
        with pytest.raises(OffloadClientError, match=r"not registered|unknown engine"):
            read_blocks_raw(address, "s3cret", 2.0, "nobody", 0, storer_chain, SLOT)
        with socket.create_connection(address, timeout=5) as s:  # garbage: an error frame, closed
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            answer = s.recv(4096)
            assert answer[:4] == b"\xff\xff\xff\xff" and b"not a block-port request" in answer
        with socket.create_connection(address, timeout=5) as s:  # the old wire: refused, by name
            s.sendall(b"KVB1" + bytes(8))
            assert b"expected b'KVB2'" in s.recv(4096)
        with OffloadClient(a.target, token="s3cret") as peer:  # the daemon is fine
            assert peer.stats().num_blocks == 0
        assert a.proc is not None and a.proc.poll() is None
        with grpc.insecure_channel(a.target) as ch:
            grpc.channel_ready_future(ch).result(timeout=5)
    finally:
        a.kill()


class _Relay:
    """A relay in front of a's block port that breaks the answer: ``cut_at`` closes both sides
    after that many bytes of the slots (the peer died mid-transfer), ``flip_at`` inverts that
    byte of the slots (bits flipped on the way); both counted from the first slot's first byte,
    past the count and the headers."""

    def __init__(self, upstream: int, cut_at: int = -1, flip_at: int = -1, pause_at: int = -1) -> None:
        self.upstream, self.cut_at, self.flip_at, self.pause_at = upstream, cut_at, flip_at, pause_at
        self.paused, self.resume = threading.Event(), threading.Event()  # pause_at: held there
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            with client, socket.create_connection(("127.0.0.1", self.upstream)) as up:
                client.settimeout(5)
                up.sendall(client.recv(1 << 20))  # the request (small: one recv)
                head = b""
                while len(head) < 8:  # u32 count, u32 header bytes
                    head += up.recv(8 - len(head))
                client.sendall(head)
                sent = -struct.unpack("!II", head)[1]  # < 0 while the headers pass
                while self.cut_at < 0 or sent < self.cut_at:
                    if 0 <= self.pause_at <= sent and not self.paused.is_set():
                        self.paused.set()
                        self.resume.wait(10)
                    try:
                        chunk = up.recv(65536)
                    except ConnectionError:  # the peer was killed: what it sent is read first
                        break
                    if not chunk:
                        break
                    if self.cut_at >= 0:
                        chunk = chunk[: self.cut_at - sent]
                    if self.flip_at >= 0 and sent <= self.flip_at < sent + len(chunk):
                        i = self.flip_at - sent
                        chunk = chunk[:i] + bytes([chunk[i] ^ 0xFF]) + chunk[i + 1:]
                    client.sendall(chunk)
                    sent += len(chunk)

    def close(self) -> None:
        self.server.close()


@pytest.mark.parametrize("fault", ["dies", "flips"])
def test_a_broken_transfer_is_never_a_wrong_block(tmp_path: Path, redis_url: str, fault: str) -> None:
    port = free_port()
    n = 2 * COMMIT_BLOCKS + 30  # three reservations; the fault in the second
    a = DaemonProcess(tmp_path / "a", redis_url, "node-a", capacity_bytes=4 * n * SLOT,
                      extra_args=("--fleet-block-port", str(port)))
    a.start()
    chain = _chain_on(a, n)
    broken = COMMIT_BLOCKS + 9  # the block cut or flipped
    relay = (_Relay(port, cut_at=broken * SLOT + SLOT // 2) if fault == "dies"
             else _Relay(port, flip_at=broken * SLOT + 7))
    b = DaemonProcess(tmp_path / "b", redis_url, "node-b", capacity_bytes=4 * n * SLOT,
                      extra_args=("--fleet-peers", f"a={a.target}/node-a@{relay.port}",
                                  "--fleet-refresh-ms", "50", "--fleet-timeout-s", "2"))
    b.start()
    try:
        time.sleep(0.5)  # b's index has a's chain
        with OffloadClient(b.target) as local:
            arena = local.register_engine("b-eng", 1, "synthetic", [GROUP]).map_arena(0)
            try:
                got = local.lookup("b-eng", [GroupQuery(0, tuple(chain))]).results[0].num_prefix
                served, bad = served_blocks_match(local, "b-eng", arena, chain)
            finally:
                arena.close()
            stats = local.stats()
        assert bad == [] and served == got
        # the blocks that arrived whole and matched their checksum are kept, the rest released
        assert got == broken and stats.num_blocks == broken
        assert all(s.num_reserved == 0 for s in stats.layouts)
        assert b.proc is not None and b.proc.poll() is None
    finally:
        relay.close()
        a.kill()
        b.kill()


BIG = replace(GROUP, block_bytes=256 << 10, layout="big-layout")  # 64 blocks: 16 MiB, more than
# the sockets buffer, so the peer is still sending when it is killed


def test_a_peer_killed_mid_transfer_costs_the_rest_never_a_wrong_block(tmp_path: Path,
                                                                        redis_url: str) -> None:
    port, n = free_port(), 64
    a = DaemonProcess(tmp_path / "a", redis_url, "node-a", capacity_bytes=2 * n * BIG.block_bytes,
                      extra_args=("--fleet-block-port", str(port)))
    a.start()
    chain = [BlockToStore(digest("big", i), digest("big", i - 1) if i else None, (i, 1, 2, 3))
             for i in range(n)]
    with OffloadClient(a.target) as c:
        arena = c.register_engine("a-eng", 1, "synthetic", [BIG]).map_arena(0)
        res = c.reserve("a-eng", 0, chain)
        for blk, (_, slot) in zip(chain, res.blocks, strict=True):
            arena.write(slot, block_bytes(blk.block_hash, BIG.block_bytes))
        c.commit("a-eng", res.reservation_id)
        arena.close()
    relay = _Relay(port, pause_at=8 * BIG.block_bytes + 100)
    b = DaemonProcess(tmp_path / "b", redis_url, "node-b", capacity_bytes=2 * n * BIG.block_bytes,
                      extra_args=("--fleet-peers", f"a={a.target}/node-a@{relay.port}",
                                  "--fleet-refresh-ms", "50", "--fleet-timeout-s", "5"))
    b.start()
    hashes = tuple(blk.block_hash for blk in chain)
    try:
        time.sleep(0.5)  # b's index has a's chain
        with OffloadClient(b.target) as local:
            arena = local.register_engine("b-eng", 1, "synthetic", [BIG]).map_arena(0)
            try:
                got: list[int] = []
                lookup = threading.Thread(target=lambda: got.append(
                    local.lookup("b-eng", [GroupQuery(0, hashes)]).results[0].num_prefix))
                lookup.start()
                assert relay.paused.wait(10)  # 8 blocks through, the peer blocked sending
                a.kill()  # SIGKILL mid-transfer
                relay.resume.set()
                lookup.join(20)
                found = local.lookup("b-eng", [GroupQuery(0, hashes, prefix_only=False)], pin=True)
                wrong = [i for i, slot in enumerate(found.results[0].slots) if slot >= 0
                         and arena.read(slot) != block_bytes(hashes[i], BIG.block_bytes)]
                stats = local.stats()
            finally:
                arena.close()
        assert got and 8 <= got[0] < n, got  # what arrived whole is kept, the rest is a miss
        assert wrong == [] and stats.num_blocks == got[0]
        assert all(s.num_reserved == 0 for s in stats.layouts)
        assert b.proc is not None and b.proc.poll() is None
        assert "fleet read from a cut short" in b.log_path.read_text()
    finally:
        relay.close()
        a.kill()
        b.kill()
