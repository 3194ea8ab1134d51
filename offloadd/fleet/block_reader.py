"""The reading side of a peer's block port (offloadd.fleet.block_port): one request, the
blocks' headers and bytes received straight into their buffers."""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

import grpc
from kvcache.v1 import offload_pb2

from offloadd import codec
from offloadd.client.errors import OffloadClientError, OffloadUnavailable
from offloadd.messages import BlockData

MAGIC = b"KVB1"  # the wire of offloadd.fleet.block_port
ERROR = 0xFFFFFFFF
_U32 = struct.Struct("!I")


def read_blocks_raw(address: tuple[str, int], token: str | None, timeout_s: float, engine_id: str,
                    group_idx: int, hashes: Sequence[bytes], slot_bytes: int) -> list[BlockData]:
    """The blocks ``hashes`` (pinned by ``engine_id`` on the peer), in order; OffloadUnavailable
    for a network failure, OffloadClientError for the peer's refusal."""
    req = codec.read_blocks_request(engine_id, group_idx, hashes).SerializeToString()
    tok = (token or "").encode()
    try:
        with socket.create_connection(address, timeout=timeout_s) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(MAGIC + struct.pack("!II", len(tok), len(req)) + tok + req)
            out = []
            for _ in hashes:
                (n,) = _U32.unpack(_recv(s, 4))
                if n == ERROR:
                    (m,) = _U32.unpack(_recv(s, 4))
                    raise OffloadClientError(grpc.StatusCode.FAILED_PRECONDITION,
                                             f"block port: {_recv(s, m).decode(errors='replace')}")
                meta = offload_pb2.BlockData.FromString(_recv(s, n))
                data = _recv(s, slot_bytes)
                out.append(BlockData(meta.block_hash, data, meta.checksum,
                                     meta.parent_block_hash or None, tuple(meta.token_ids),
                                     meta.extra_keys,
                                     meta.lora_name if meta.HasField("lora_name") else None))
            return out
    except (OSError, struct.error) as exc:
        raise OffloadUnavailable(grpc.StatusCode.UNAVAILABLE, f"block port {address}: {exc}") from exc


def _recv(s: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes: usually one ``recv`` with MSG_WAITALL (one copy, from the kernel)."""
    data = s.recv(n, socket.MSG_WAITALL)
    if len(data) == n:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = s.recv(n - got, socket.MSG_WAITALL)
        if not more:
            raise ConnectionError(f"closed after {got} of {n} bytes")
        parts.append(more)
        got += len(more)
    return b"".join(parts)
