"""A checkpoint's chunks encoded by a forked child, as Redis's BGSAVE does (DECISIONS 39, 51).

Exporting the reducer's state is pure Python work proportional to the resident blocks (about a
second for 100k blocks on the 2-core machine); done on the daemon's event loop it stalls every
request and stream that long. ``fork()`` instead gives a child an exact copy of the state at this
instant (copy-on-write: the parent keeps applying records at once); the child exports it,
encodes the chunks and streams them through a pipe as ``[length, xxh3][data]`` frames ended by a
done frame, then exits with ``os._exit`` (no atexit, no finalizers, no asyncio, no gRPC in the
child). The parent only reads frames and writes them to Redis. A child that dies or writes a
torn stream fails the checkpoint (the previous one stays in force). Without ``os.fork`` the
export runs in the loop, yielding between chunks.

The child must run nothing of the parent's but this module's loop: gRPC core's fork handlers
are off in the daemon's process (set in ``offloadd/__init__`` before grpc loads; on, they
restart gRPC's threads in the child, which crashed it), and the cyclic collector is off across
the fork, so no collection in the child runs finalizers of inherited gRPC, asyncio or Redis
objects (their C state belongs to threads the child does not have).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import struct
from collections.abc import AsyncGenerator
from typing import Final, NoReturn

from events.checkpoint import encode_chunk, split
from events.state import CacheState

_FRAME: Final = struct.Struct("<QQ")  # data length, xxh3_64 of the data
_DONE: Final[int] = (1 << 64) - 1  # the length of the frame that ends a complete stream


class ExportFailed(Exception):
    """The child did not deliver every chunk (it died, or the stream was torn)."""


async def export_chunks(state: CacheState, per_chunk: int, fork: bool = True
                        ) -> AsyncGenerator[tuple[bytes, int], None]:
    """The state's checkpoint chunks as ``(data, xxh3)``, in order; ExportFailed when the
    export could not finish."""
    if not fork or not hasattr(os, "fork"):
        for part in split(state.export(), per_chunk):
            yield encode_chunk(part)
            await asyncio.sleep(0)
        return
    r, w = os.pipe()
    # What is alive now leaves the collector's view (as recovery's state does, and kv-bridge's
    # after each chunk): a full collection in the parent while the child runs would write to
    # every tracked object's header, copying each page the two still share, all at once.
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()  # the child starts with the collector off (module docstring)
    try:
        pid = os.fork()
        if pid == 0:
            _child(state, per_chunk, r, w)
    finally:
        if was_enabled:
            gc.enable()  # the parent; the child never returns from _child
    os.close(w)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20, loop=loop)
    pipe = os.fdopen(r, "rb", buffering=0)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe)
    done = False
    try:
        while True:
            try:
                length, checksum = _FRAME.unpack(await reader.readexactly(_FRAME.size))
                if length == _DONE:
                    done = True
                    break
                data = await reader.readexactly(length)
            except asyncio.IncompleteReadError:
                break
            yield data, checksum
    finally:
        transport.close()
        if not done:
            _kill(pid)
        _, status = await loop.run_in_executor(None, os.waitpid, pid, 0)
    if not done or status != 0:
        raise ExportFailed(f"the export process ended with status {status} before its last chunk")


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)  # our own child: a reader that stopped wants no more


def _child(state: CacheState, per_chunk: int, r: int, w: int) -> NoReturn:
    code = 1
    try:
        os.close(r)
        gc.disable()  # already off (export_chunks); it exits soon, collecting would only copy pages
        os.nice(10)  # background work: the daemon's requests come first on a busy machine
        signal.set_wakeup_fd(-1)  # the loop's wakeup fd is the parent's: leave it alone
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        with open(w, "wb", closefd=True) as out:
            for part in split(state.export(), per_chunk):
                data, checksum = encode_chunk(part)
                out.write(_FRAME.pack(len(data), checksum))
                out.write(data)
            out.write(_FRAME.pack(_DONE, 0))
        code = 0
    finally:
        os._exit(code)
