"""Block bytes for peers' daemons over a raw TCP socket (``--fleet-block-port``, issue 21).

ReadBlocks over gRPC tops out well below a bare socket (docs/BENCHMARKS.md, cross-node), so a
daemon may also serve the same read on a plain TCP port, its slots sent straight from the
arena files with ``sendfile`` (no copy through Python). One request per connection, for a whole
chain: the port pins the ready prefix of the hashes itself (a Lookup with pin, under the
reader's engine id, registered over gRPC with the layout's spec), sends every header first (the
reader reserves its slots before the bytes come), then the slots back to back (adjacent slots
of one file in one ``sendfile``), and releases the pin. The wire is in
offloadd.fleet.block_reader. The bearer token is the daemon's own (``--auth-token-file``),
compared in constant time before anything else is looked at. Plaintext only: a daemon with TLS
refuses the flag (sendfile cannot encrypt), and its peers read over gRPC (DECISIONS 44, 55).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import select
import socket
import struct

from kvcache.v1 import offload_pb2

from offloadd import codec
from offloadd.edge.service import parse
from offloadd.errors import InvalidArgument, RequestError
from offloadd.fleet.block_reader import ERROR, MAGIC, SOCKET_BUFFER
from offloadd.messages import BlockData, GroupQuery
from offloadd.tier.store import HostStore

log = logging.getLogger(__name__)

MAX_TOKEN_BYTES = 4096
MAX_REQUEST_BYTES = 16 << 20
_HEAD = struct.Struct("!4sII")
_U32 = struct.Struct("!I")


class BlockPort:
    def __init__(self, store: HostStore, token: str | None, timeout_s: float = 10.0) -> None:
        self.store = store
        self.token = None if token is None else token.encode()
        self.timeout_s = timeout_s
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host.strip("[]"), port)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lease: tuple[str, str] | None = None  # (engine id, lease id) of the pin
        try:
            try:
                lease, head, ranges = await asyncio.wait_for(self._request(reader), self.timeout_s)
            except (RequestError, asyncio.IncompleteReadError, TimeoutError) as exc:
                why = str(exc) if isinstance(exc, RequestError) else "incomplete or slow request"
                msg = why.encode()[:4096]
                writer.write(_U32.pack(ERROR) + _U32.pack(len(msg)) + msg)
                return
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            await asyncio.to_thread(_send_all, sock.fileno(), head, ranges, self.timeout_s)
        except (ConnectionError, OSError, TimeoutError) as exc:  # the reader went away: it retries
            log.info("block port: reader went away: %s", exc)
        finally:
            if lease is not None:
                with contextlib.suppress(RequestError):  # expired meanwhile: unpinned already
                    self.store.release(*lease)
            writer.close()

    async def _request(self, reader: asyncio.StreamReader
                       ) -> tuple[tuple[str, str] | None, bytes, list[tuple[int, int, int]]]:
        magic, token_len, req_len = _HEAD.unpack(await reader.readexactly(_HEAD.size))
        if magic != MAGIC or token_len > MAX_TOKEN_BYTES or req_len > MAX_REQUEST_BYTES:
            raise InvalidArgument(f"not a block-port request (expected {MAGIC!r} and sane lengths)")
        token = await reader.readexactly(token_len)
        raw = await reader.readexactly(req_len)
        if self.token is not None and not hmac.compare_digest(token, self.token):
            raise InvalidArgument("UNAUTHENTICATED: missing or wrong bearer token")
        req = parse(raw, offload_pb2.ReadBlocksRequest, "block port")
        return self._plan(req.engine_id, req.group_idx, list(req.block_hashes))

    def _plan(self, engine_id: str, group_idx: int, hashes: list[bytes]
              ) -> tuple[tuple[str, str] | None, bytes, list[tuple[int, int, int]]]:
        """Pin the ready prefix of ``hashes`` (checked as Lookup checks: ready, verified);
        the answer's head (count and headers) and the (file, offset, size) ranges to send."""
        store = self.store
        layout = store.layout_of(store.engine(engine_id), group_idx)
        found = store.lookup(engine_id, [GroupQuery(group_idx, tuple(hashes), prefix_only=True)],
                             True, int(self.timeout_s * 1000) + 30_000)
        lease = (engine_id, found.lease_id) if found.lease_id else None
        headers: list[bytes] = []
        ranges: list[tuple[int, int, int]] = []
        size = layout.geometry.slot_bytes
        for d in hashes[:found.results[0].num_prefix]:
            entry = layout.index.entry(d)
            meta = codec.block_data_wire(BlockData(d, b"", entry.checksum, entry.parent,
                                                   entry.token_ids, entry.extra_keys, entry.lora_name))
            headers.append(_U32.pack(len(meta)) + meta)
            fd, offset = layout.arena.file_of(entry.slot)
            if ranges and ranges[-1][0] == fd and ranges[-1][1] + ranges[-1][2] == offset:
                ranges[-1] = (fd, ranges[-1][1], ranges[-1][2] + size)  # adjacent: one sendfile
            else:
                ranges.append((fd, offset, size))
        body = b"".join(headers)
        return lease, _U32.pack(len(headers)) + _U32.pack(len(body)) + body, ranges


def _send_all(sock_fd: int, head: bytes, ranges: list[tuple[int, int, int]], timeout_s: float) -> None:
    """Everything is written by one worker thread straight to the socket (the transport's
    buffer stays empty: nothing else writes to it), the bytes by ``os.sendfile``."""
    poll = select.poll()
    poll.register(sock_fd, select.POLLOUT)

    def wait() -> None:
        if not poll.poll(int(timeout_s * 1000)):
            raise TimeoutError("the reader stopped reading")

    view = memoryview(head)
    while view:
        try:
            view = view[os.write(sock_fd, view):]
        except BlockingIOError:
            wait()
    for fd, offset, size in ranges:
        end = offset + size
        while offset < end:
            try:
                n = os.sendfile(sock_fd, fd, offset, end - offset)
            except BlockingIOError:
                wait()
                continue
            if n == 0:
                raise ConnectionError("arena file shorter than its slot")
            offset += n
