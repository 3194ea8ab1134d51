"""Block bytes for peers' daemons over a raw TCP socket (``--fleet-block-port``, issue 21).

ReadBlocks over gRPC tops out well below a bare socket (docs/BENCHMARKS.md, cross-node), so a
daemon may also serve the same read on a plain TCP port, its slots sent straight from the
arena files with ``sendfile`` (no copy through Python). One request per connection:

    request:  b"KVB1", u32 token length, u32 request length, token, ReadBlocksRequest
    answer:   per block, u32 n, n bytes of BlockData without ``data`` (hash, checksum,
              identity), then the slot's bytes; or u32 0xFFFFFFFF, u32 n, an n-byte message
              (the error), and the connection closes

All integers big-endian. The reader must hold the blocks pinned (its Lookup over gRPC, under
the same engine id), as for ReadBlocks; the bearer token is the daemon's own
(``--auth-token-file``), compared in constant time. Plaintext only: a daemon with TLS refuses
the flag (sendfile cannot encrypt), and its peers read over gRPC.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import select
import struct

from kvcache.v1 import offload_pb2

from offloadd import codec
from offloadd.edge.service import parse
from offloadd.errors import InvalidArgument, RequestError
from offloadd.fleet.block_reader import ERROR, MAGIC
from offloadd.messages import BlockData
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
        try:
            try:
                plan = await asyncio.wait_for(self._request(reader), self.timeout_s)
            except (RequestError, asyncio.IncompleteReadError, TimeoutError) as exc:
                why = str(exc) if isinstance(exc, RequestError) else "incomplete or slow request"
                msg = why.encode()[:4096]
                writer.write(_U32.pack(ERROR) + _U32.pack(len(msg)) + msg)
                return
            await self._send(writer, plan)
        except (ConnectionError, OSError, TimeoutError) as exc:  # the reader went away: it retries
            log.info("block port: reader went away: %s", exc)
        finally:
            writer.close()

    async def _request(self, reader: asyncio.StreamReader) -> list[tuple[bytes, int, int, int]]:
        magic, token_len, req_len = _HEAD.unpack(await reader.readexactly(_HEAD.size))
        if magic != MAGIC or token_len > MAX_TOKEN_BYTES or req_len > MAX_REQUEST_BYTES:
            raise InvalidArgument("not a block-port request (expected KVB1 and sane lengths)")
        token = await reader.readexactly(token_len)
        raw = await reader.readexactly(req_len)
        if self.token is not None and not hmac.compare_digest(token, self.token):
            raise InvalidArgument("UNAUTHENTICATED: missing or wrong bearer token")
        req = parse(raw, offload_pb2.ReadBlocksRequest, "block port")
        return self._plan(req.engine_id, req.group_idx, list(req.block_hashes))

    def _plan(self, engine_id: str, group_idx: int, hashes: list[bytes]) -> list[tuple[bytes, int, int, int]]:
        """Per block: its header, file, offset and size; every block checked before any is sent
        (ReadBlocks' rules: ready, verified, its file still holding it)."""
        store = self.store
        layout = store.layout_of(store.engine(engine_id), group_idx)
        store.check_count(len(hashes), "block_hashes")
        store.check_arena()
        out = []
        for i, d in enumerate(hashes):
            store.check_digest(d, f"block_hashes[{i}]")
            entry = layout.index.ready(d)
            if entry is not None and not entry.verified and not store.integrity.verify(layout, d):
                entry = None
            if entry is None:
                raise InvalidArgument(f"NOT_FOUND: block_hashes[{i}] is not resident in group {group_idx}")
            meta = codec.block_data_wire(BlockData(d, b"", entry.checksum, entry.parent,
                                                   entry.token_ids, entry.extra_keys, entry.lora_name))
            fd, offset = layout.arena.file_of(entry.slot)
            out.append((_U32.pack(len(meta)) + meta, fd, offset, layout.geometry.slot_bytes))
        return out

    async def _send(self, writer: asyncio.StreamWriter, plan: list[tuple[bytes, int, int, int]]) -> None:
        """Everything is written by one worker thread straight to the socket (the transport's
        buffer stays empty: nothing else writes to it), the bytes by ``os.sendfile``."""
        sock = writer.get_extra_info("socket")
        await asyncio.to_thread(_send_all, sock.fileno(), plan, self.timeout_s)


def _send_all(sock_fd: int, plan: list[tuple[bytes, int, int, int]], timeout_s: float) -> None:
    poll = select.poll()
    poll.register(sock_fd, select.POLLOUT)

    def wait() -> None:
        if not poll.poll(int(timeout_s * 1000)):
            raise TimeoutError("the reader stopped reading")

    for head, fd, offset, size in plan:
        view = memoryview(head)
        while view:
            try:
                view = view[os.write(sock_fd, view):]
            except BlockingIOError:
                wait()
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
