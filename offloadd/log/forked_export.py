"""A checkpoint's chunks cut in the loop in slices, or by a forked child as Redis's BGSAVE does
(DECISIONS 39, 51, 60, 65, 68).

An export cuts the blocks events.checkpoint_delta planned (``parts``: what changed since the
previous export, or whole tiers). Few blocks (the common case: what was appended since the
previous checkpoint) are cut in the event loop in slices of ~1 ms, each followed by a pause
twice as long (the export takes at most a third of a busy loop, which keeps up with its
streams meanwhile): no fork, whose page-table copy stalls the loop longer than such a copy
(DECISIONS 65). They are copied at the export's instant (C speed, from each tier's end), but
a tier's tail may be read when its turn comes instead, a window at a time, for as long as the
tier's changes since leave it where it was (offloadd.log.later_read, DECISIONS 74 and 81:
TierMoved gives the export up otherwise).
Many (the first export after a start, a tier cleared, removals all over a tier) go to a forked
child: ``fork()`` gives it an exact copy of the state at this instant (copy-on-write: the parent
keeps applying records at once); the child cuts it, encodes the chunks whose segments are not in
``known``, and streams one frame per chunk through a pipe, ``[kind, address, fingerprint,
length, end, number of keys]``, the segment's block hashes (8 bytes each: the parent maps them
to the segment, events.checkpoint_book), then the bytes unless Redis holds them already
(``present``), ended by a done frame; then it exits with ``os._exit`` (no atexit, no finalizers,
no asyncio, no gRPC in the child). The parent only reads frames and writes new chunks to Redis.
A child that dies or writes a torn stream fails the checkpoint (the previous one stays in
force). Without ``os.fork`` every export runs in the loop.

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
import time
from array import array
from collections.abc import AsyncGenerator, Container, Mapping
from typing import Final, NoReturn

from events.checkpoint_cut import Cuts, Piece
from events.checkpoint_delta import TierTail, cut_tails
from offloadd.log.later_read import Later, cut_later

_FRAME: Final = struct.Struct("<B16s16sQQQ")  # kind, address, fingerprint, chunk length, end, keys
_SLICE_S: Final = 0.0005  # in the loop: yield once this much work was done (~1 segment)
_PAUSE: Final = 2.0  # ... and let the loop have twice that time: the export takes <= 1/3 of it
_REF, _DATA, _DONE = 0, 1, 2  # kinds: a chunk Redis holds; one whose bytes follow; the end


async def _cut_now(part: TierTail, cuts: Cuts, known: Mapping[bytes, tuple[str, int]],
                   present: Container[str]) -> AsyncGenerator[Piece | None, None]:
    """``part``'s pieces, its blocks copied (events.checkpoint_delta.cut_tails)."""
    for piece in cut_tails([part], cuts, known, present):
        yield piece


class ExportFailed(Exception):
    """The child did not deliver every chunk (it died, or the stream was torn), or there was
    none (``fork`` failed: no memory or processes left)."""


async def export_pieces(parts: list[TierTail], cuts: Cuts, known: Mapping[bytes, tuple[str, int]],
                        present: Container[str], fork: bool = True, fork_s: list[float] | None = None,
                        later: Later | None = None) -> AsyncGenerator[Piece, None]:
    """The chunks of ``parts`` (events.checkpoint_delta.tails of the state now, taken with no
    await since), in order; ExportFailed when the export could not finish. ``fork``: in a
    forked child (else in the loop; ``parts`` left uncopied are copied at once, but those of
    the tiers ``later`` names, read from the live tier when their turn comes:
    offloadd.log.later_read.TierMoved if one's tail moved by then). ``fork_s`` gets how long
    the fork took."""
    if not fork or not hasattr(os, "fork"):
        lazy = later.tiers if later is not None else ()
        parts = [p if p.live is None or p.tier in lazy else p.copied() for p in parts]  # the instant
        loop = asyncio.get_running_loop()
        since = loop.time()
        for part in parts:
            cut = (_cut_now(part, cuts, known, present) if part.live is None or later is None
                   else cut_later(part, later, cuts, known, present))
            async for piece in cut:
                if piece is not None:
                    yield piece
                work = loop.time() - since
                if work >= _SLICE_S:  # a busy loop keeps up with its stream meanwhile
                    await asyncio.sleep(work * _PAUSE)
                    since = loop.time()
        return
    r, w = os.pipe()
    # What is alive now leaves the collector's view (as recovery's state does, and kv-bridge's
    # after each chunk): a full collection in the parent while the child runs would write to
    # every tracked object's header, copying each page the two still share, all at once.
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()  # the child starts with the collector off (module docstring)
    started = time.perf_counter()
    try:
        try:
            pid = os.fork()
        except OSError as exc:  # EAGAIN, ENOMEM: no child, and the pipe is ours to close
            os.close(r)
            os.close(w)
            raise ExportFailed(f"could not fork the export process: {exc}") from exc
        if pid == 0:
            _child(parts, (cuts, known, present), r, w)
    finally:
        if was_enabled:
            gc.enable()  # the parent; the child never returns from _child
    if fork_s is not None:
        fork_s.append(time.perf_counter() - started)  # the loop's stall: page tables copied
    os.close(w)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20, loop=loop)
    pipe = os.fdopen(r, "rb", buffering=0)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe)
    done = False
    try:
        while True:
            try:
                kind, address, fp, length, end, num_keys = _FRAME.unpack(
                    await reader.readexactly(_FRAME.size))
                if kind == _DONE:
                    done = True
                    break
                keys = array("Q", await reader.readexactly(8 * num_keys))
                data = await reader.readexactly(length) if kind == _DATA else None
            except asyncio.IncompleteReadError:
                break
            yield Piece(address.hex(), length, fp, data, end, keys)
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


def _child(parts: list[TierTail], args: tuple[Cuts, Mapping[bytes, tuple[str, int]], Container[str]],
           r: int, w: int) -> NoReturn:
    code = 1
    try:
        os.close(r)
        gc.disable()  # already off (export_chunks); it exits soon, collecting would only copy pages
        os.nice(10)  # background work: the daemon's requests come first on a busy machine
        signal.set_wakeup_fd(-1)  # the loop's wakeup fd is the parent's: leave it alone
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        with open(w, "wb", closefd=True) as out:
            for piece in cut_tails(parts, *args):
                kind = _REF if piece.data is None else _DATA
                keys = array("Q", piece.keys or ())
                out.write(_FRAME.pack(kind, bytes.fromhex(piece.address), piece.fingerprint,
                                      piece.length, piece.end, len(keys)))
                out.write(keys.tobytes())
                if piece.data is not None:
                    out.write(piece.data)
            out.write(_FRAME.pack(_DONE, b"", b"", 0, 0, 0))
        code = 0
    finally:
        os._exit(code)
