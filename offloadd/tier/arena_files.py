"""The daemon's side of the arena: chunk files read with ``pread`` (DECISIONS 27)."""

from __future__ import annotations

import logging
import os

from offloadd.arena import ArenaGeometry

log = logging.getLogger(__name__)


class ArenaFiles:
    """The daemon's handle on one layout's chunk files: read with ``pread``, never mapped.

    Engines may write the files, so they may also truncate them; the daemon must survive that,
    and a mapped page past a file's end would kill it with SIGBUS. A short read means the file
    shrank: :meth:`read` returns None and :meth:`check` reports and repairs it.
    """

    def __init__(self, geometry: ArenaGeometry) -> None:
        self.geometry = geometry
        self._fds: list[int] = []
        self._buf = memoryview(bytearray(geometry.slot_bytes))  # reused by every read
        self._reported: dict[int, int] = {}  # chunk -> a wrong size it could not be given back

    @property
    def num_chunks(self) -> int:
        return len(self._fds)

    def open_chunk(self, chunk: int) -> None:
        """Open the next chunk file (created by the caller)."""
        assert chunk == len(self._fds), "chunks are opened in order"
        self._fds.append(os.open(self.geometry.chunk_path(chunk), os.O_RDWR))

    def read_view(self, slot: int) -> memoryview | None:
        """The slot's bytes in a buffer valid until the next read; None if the file is too
        short to hold them."""
        g = self.geometry
        if not 0 <= slot < len(self._fds) * g.slots_per_chunk:
            raise IndexError(f"slot {slot} outside the {len(self._fds)} open chunks")
        if os.preadv(self._fds[g.chunk_of(slot)], [self._buf], g.offset_of(slot)) != g.slot_bytes:
            return None
        return self._buf

    def file_of(self, slot: int) -> tuple[int, int]:
        """(file descriptor, offset) of a slot, for ``sendfile`` (offloadd.fleet.block_port)."""
        g = self.geometry
        if not 0 <= slot < len(self._fds) * g.slots_per_chunk:
            raise IndexError(f"slot {slot} outside the {len(self._fds)} open chunks")
        return self._fds[g.chunk_of(slot)], g.offset_of(slot)

    def write(self, slot: int, data: bytes) -> bool:
        """Write a whole slot (the daemon storing a block fetched from a peer, issue 21);
        False if the file is too short to hold it."""
        g = self.geometry
        if len(data) != g.slot_bytes or not 0 <= slot < len(self._fds) * g.slots_per_chunk:
            raise ValueError(f"slot {slot}: {len(data)} bytes for a {g.slot_bytes}-byte slot")
        fd = self._fds[g.chunk_of(slot)]
        if os.fstat(fd).st_size < g.offset_of(slot) + g.slot_bytes:
            return False  # writing would grow a file an engine truncated
        return os.pwrite(fd, data, g.offset_of(slot)) == g.slot_bytes

    def read(self, slot: int) -> bytes | None:
        view = self.read_view(slot)
        return None if view is None else view.tobytes()

    def check(self) -> dict[int, int]:
        """Chunk files another process resized: each is logged, given back its size, and
        returned as chunk -> the size found. A file that shrank lost the bytes past that size."""
        want = self.geometry.chunk_file_bytes
        resized: dict[int, int] = {}
        for chunk, fd in enumerate(self._fds):
            size = os.fstat(fd).st_size
            if size == want or self._reported.get(chunk) == size:
                continue
            resized[chunk] = size
            path = self.geometry.chunk_path(chunk)
            log.warning("arena chunk %s has %d bytes, expected %d (resized by another process): "
                        "dropping the blocks it lost and restoring its size", path, size, want)
            try:
                os.ftruncate(fd, want)
                self._reported.pop(chunk, None)
            except OSError as exc:
                log.error("arena chunk %s: cannot restore its size: %s", path, exc)
                self._reported[chunk] = size
        return resized

    def lost_slots(self, chunk: int, size: int) -> range:
        """The slots of ``chunk`` whose bytes a file of ``size`` bytes no longer holds."""
        g = self.geometry
        first = chunk * g.slots_per_chunk
        return range(first + min(size // g.slot_bytes, g.slots_per_chunk), first + g.slots_per_chunk)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
