"""The reading side of a peer's block port (offloadd.fleet.block_port): one request for a whole
chain, then the blocks' headers (known before any byte: the reader reserves its slots first),
then their bytes, received in large pieces into one reused buffer, each block hashed (xxh3) once
while it is in the cache and handed to a sink (the fill ``pwrite``s it into its reserved slot).

The wire (all integers big-endian):

    request:  MAGIC, u32 token length, u32 request length, token, ReadBlocksRequest
    answer:   u32 n (the peer's ready prefix of the hashes, pinned by the peer while it sends),
              u32 h, h bytes of n headers (u32 m, m bytes of BlockData without ``data``),
              then the n slots' bytes back to back;
              or u32 ERROR, u32 m, an m-byte message, and the connection closes
"""

from __future__ import annotations

import contextlib
import queue
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from types import TracebackType

import grpc
import xxhash
from google.protobuf.message import DecodeError
from kvcache.v1 import offload_pb2

from offloadd import codec
from offloadd.client.errors import OffloadClientError, OffloadUnavailable
from offloadd.messages import BlockData

MAGIC = b"KVB2"  # KVB1 (one block header before each slot, pin by a Lookup first) is refused
ERROR = 0xFFFFFFFF
MAX_HEADER_BYTES = 64 << 20
SOCKET_BUFFER = 8 << 20  # the kernel keeps receiving while a piece is hashed and written
PIECE_BYTES = 1 << 20  # bytes per receive call (whole blocks)
RING_PIECES = 4
_U32 = struct.Struct("!I")

Sink = Callable[[int, memoryview], None]
"""Called per block, in order, with its index and its bytes (valid until the call returns)."""


class PeerStream:
    """One block-port read, open: :attr:`blocks` are the headers (``data`` empty) of the
    blocks that will follow, in order; :meth:`receive` takes their bytes."""

    def __init__(self, sock: socket.socket, blocks: list[BlockData], slot_bytes: int,
                 address: tuple[str, int]) -> None:
        self.sock = sock
        self.blocks = blocks
        self.slot_bytes = slot_bytes
        self.address = address
        self.error = ""  # why receive() stopped early
        self.sums: list[int] = []  # the checksums of the blocks received so far

    @classmethod
    def open(cls, address: tuple[str, int], token: str | None, timeout_s: float, engine_id: str,
             group_idx: int, hashes: Sequence[bytes], slot_bytes: int) -> PeerStream:
        """Send the request and read the headers; OffloadUnavailable for a network failure,
        OffloadClientError for the peer's refusal."""
        req = codec.read_blocks_request(engine_id, group_idx, hashes).SerializeToString()
        tok = (token or "").encode()
        try:
            sock = socket.create_connection(address, timeout=timeout_s)
        except OSError as exc:
            raise OffloadUnavailable(grpc.StatusCode.UNAVAILABLE, f"block port {address}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
            sock.sendall(MAGIC + struct.pack("!II", len(tok), len(req)) + tok + req)
            (n,) = _U32.unpack(_recv(sock, 4))
            (h,) = _U32.unpack(_recv(sock, 4))
            if n == ERROR:
                raise OffloadClientError(grpc.StatusCode.FAILED_PRECONDITION,
                                         f"block port: {_recv(sock, h).decode(errors='replace')}")
            if n > len(hashes) or h > MAX_HEADER_BYTES:
                raise OffloadClientError(grpc.StatusCode.INTERNAL,
                                         f"block port: {n} blocks, {h} header bytes for {len(hashes)} asked")
            return cls(sock, _headers(_recv(sock, h), n), slot_bytes, address)
        except (OSError, struct.error, ValueError, DecodeError) as exc:
            sock.close()
            raise OffloadUnavailable(grpc.StatusCode.UNAVAILABLE, f"block port {address}: {exc}") from exc
        except BaseException:
            sock.close()
            raise

    def receive(self, count: int, sink: Sink,
                progress: Callable[[int, int], None] | None = None) -> list[int]:
        """The bytes of the first ``count`` blocks, each given to ``sink``; their xxh3 checksums
        as computed here. Fewer when the peer stopped or ``sink`` raised (:attr:`error` says
        why): a block is counted only once all its bytes were received and sunk. ``progress``
        is called (on this thread) with each block's index and checksum once it is sunk.

        A thread of its own only reads the socket, into a ring of pieces of whole blocks; this
        one hashes and sinks each piece while the next arrives."""
        size = self.slot_bytes
        per = max(1, min(count, PIECE_BYTES // size))
        ring = [memoryview(bytearray(per * size)) for _ in range(RING_PIECES)]
        free: queue.SimpleQueue[int] = queue.SimpleQueue()  # pieces to fill; -1: stop
        full: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()  # (piece, blocks)
        for i in range(RING_PIECES):
            free.put(i)
        errors: list[str] = []
        sums = self.sums = []  # read by other threads while it grows

        def read() -> None:
            left = count
            try:
                while left:
                    i = free.get()
                    if i < 0:
                        return
                    k = min(per, left)
                    got = _recv_whole(self.sock, ring[i][:k * size], size)
                    full.put((i, got // size))
                    if got < k * size:
                        errors.append(f"closed after {count - left + got // size} whole blocks")
                        return
                    left -= k
            except OSError as exc:  # timed out, reset
                errors.append(str(exc))
            finally:
                full.put(None)

        reader = threading.Thread(target=read, name="block-port-read", daemon=True)
        reader.start()
        try:
            while (item := full.get()) is not None:
                i, k = item
                for j in range(k):
                    block = ring[i][j * size:(j + 1) * size]
                    checksum = xxhash.xxh3_64_intdigest(block)
                    sink(len(sums), block)
                    sums.append(checksum)
                    if progress is not None:
                        progress(len(sums) - 1, checksum)
                free.put(i)
        except (OSError, ValueError) as exc:  # the sink refused the slot
            errors.append(str(exc))
        finally:  # whatever stopped this loop stops the reader too
            free.put(-1)
            if reader.is_alive():
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
            reader.join()
        if errors:
            self.error = f"block port {self.address}: {errors[0]}"
        return sums

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> PeerStream:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def read_blocks_raw(address: tuple[str, int], token: str | None, timeout_s: float, engine_id: str,
                    group_idx: int, hashes: Sequence[bytes], slot_bytes: int) -> list[BlockData]:
    """The peer's ready prefix of ``hashes``, with their bytes (tools, tests, the benchmark);
    OffloadUnavailable for a network failure or a transfer cut short, OffloadClientError for
    the peer's refusal."""
    with PeerStream.open(address, token, timeout_s, engine_id, group_idx, hashes, slot_bytes) as s:
        data: list[bytes] = []
        s.receive(len(s.blocks), lambda _i, view: data.append(view.tobytes()))
        if len(data) < len(s.blocks):
            raise OffloadUnavailable(grpc.StatusCode.UNAVAILABLE, s.error)
        return [BlockData(b.block_hash, d, b.checksum, b.parent_block_hash, b.token_ids,
                          b.extra_keys, b.lora_name) for b, d in zip(s.blocks, data, strict=True)]


def _headers(raw: bytes, n: int) -> list[BlockData]:
    out = []
    at = 0
    for _ in range(n):
        (m,) = _U32.unpack_from(raw, at)
        meta = offload_pb2.BlockData.FromString(raw[at + 4:at + 4 + m])
        at += 4 + m
        out.append(codec.block_data_from_proto(meta))
    if at != len(raw):
        raise ValueError(f"block port: {len(raw) - at} header bytes left over")
    return out


def _recv(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(s, memoryview(buf))
    return bytes(buf)


def _recv_whole(s: socket.socket, view: memoryview, size: int) -> int:
    """Fill ``view``; how many bytes came (fewer: the peer closed; a timeout raises)."""
    got, n = 0, len(view)
    while got < n:
        k = s.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if not k:
            break
        got += k
    return got


def _recv_into(s: socket.socket, view: memoryview) -> None:
    """Fill ``view`` (usually one ``recv_into`` with MSG_WAITALL); ConnectionError if the peer
    closed first."""
    got, n = 0, len(view)
    while got < n:  # the socket's timeout bounds each call
        k = s.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if not k:
            raise ConnectionError(f"closed after {got} of {n} bytes")
        got += k
