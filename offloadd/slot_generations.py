"""Per slot of a layout, the generation of the block it serves now, in a file beside the
layout's chunk files (offloadd.arena): the daemon publishes, engines read it mapped.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterable

from offloadd.arena import create_chunk_file

log = logging.getLogger(__name__)


def generations_path(chunk_path_template: str) -> str:
    """The layout's slot generation table (:class:`SlotGenerations`), beside its chunk files."""
    return chunk_path_template.format(chunk="gen")


GENERATION_BYTES = 8
"""One native-endian uint64 per slot: the daemon and its engines share the machine."""


class SlotGenerations:
    """Per slot, the generation of the block it serves now (0: none), published in shared
    memory so that an engine can check what it remembered without asking (DECISIONS 22).

    The daemon writes it (``writable``): a slot's entry is the block's generation while the
    block is READY and verified, and 0 from the moment it stops being servable (evicting,
    removed) or the slot is handed to a writer. Generations are never reused, so a reader that
    sees the same non-zero value before and after reading the slot read that block's bytes.

    Engines map the file read-only. The daemon never maps it: a process that may write the
    file may also truncate it, and a mapped page past the end kills the reader with SIGBUS.
    The daemon keeps the table in private memory and writes each change with ``pwrite``;
    :meth:`check` restores a resized file (size and every entry).
    """

    def __init__(self, path: str, max_slots: int, *, writable: bool = False) -> None:
        self.path = path
        self._size = max_slots * GENERATION_BYTES
        self._fd = -1
        self._mm: mmap.mmap | None = None
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if st.st_size < self._size:
                raise ValueError(f"generation table {path} is smaller than {self._size} bytes")
            self.inode = st.st_ino
            if writable:
                private = bytearray(self._size)
                self.values = memoryview(private).cast("Q")
                self._fd, fd = fd, -1
            else:
                self._mm = mmap.mmap(fd, self._size, mmap.MAP_SHARED, mmap.PROT_READ)
                self.values = memoryview(self._mm).cast("Q")
        finally:
            if fd >= 0:
                os.close(fd)

    @classmethod
    def create(cls, path: str, max_slots: int, mode: int, gid: int | None) -> SlotGenerations:
        """The daemon's table, all zeros: nothing is servable until published again."""
        create_chunk_file(path, max_slots * GENERATION_BYTES, mode, gid)
        table = cls(path, max_slots, writable=True)
        table.clear()
        return table

    def clear(self) -> None:
        self.values[:] = memoryview(bytes(self._size)).cast("Q")
        self._write(0, self.values.cast("B"))

    def __setitem__(self, slot: int, generation: int) -> None:
        self.values[slot] = generation
        if self.check():  # wrote every entry, this one included
            return
        start = slot * GENERATION_BYTES
        self._write(start, self.values.cast("B")[start : start + GENERATION_BYTES])

    def set_many(self, items: Iterable[tuple[int, int]]) -> None:
        """Many (slot, generation) entries with one write of the table (recovery publishes
        every restored block at once: one pwrite and one fstat each would cost seconds)."""
        values = self.values
        for slot, generation in items:
            values[slot] = generation
        if not self.check():  # check() rewrote the whole table when the file was resized
            self._write(0, values.cast("B"))

    def is_clear(self) -> bool:
        """Every entry is 0 (in the daemon's copy): publishing 0s would change nothing."""
        raw = self.values.cast("B")
        return raw.tobytes() == bytes(len(raw))

    def __getitem__(self, slot: int) -> int:
        return int(self.values[slot])

    def __len__(self) -> int:
        return len(self.values)

    def _write(self, offset: int, data: memoryview) -> None:
        if self._fd < 0:
            raise TypeError(f"generation table {self.path} is mapped read-only")
        try:
            if os.pwrite(self._fd, data, offset) == len(data):
                return
            log.error("generation table %s: short write at %d", self.path, offset)
        except OSError as exc:
            log.error("generation table %s: write at %d failed: %s", self.path, offset, exc)

    def check(self) -> bool:
        """The daemon's check of its file, before each write and by the sweep: if another
        process resized it (a write past a shortened end would grow it back with zeros where
        entries were), log it, restore the size and write every entry again. Returns whether
        the file had been resized."""
        if self._fd < 0:
            return False
        size = os.fstat(self._fd).st_size
        if size == self._size:
            return False
        log.warning("generation table %s has %d bytes, expected %d (resized by another "
                    "process): restoring it", self.path, size, self._size)
        try:
            os.ftruncate(self._fd, self._size)
        except OSError as exc:
            log.error("generation table %s: cannot restore its size: %s", self.path, exc)
        self._write(0, self.values.cast("B"))
        return True

    def is_stale(self) -> bool:
        """True when the file was replaced or removed (the daemon made a new arena)."""
        try:
            return os.stat(self.path).st_ino != self.inode
        except FileNotFoundError:
            return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            return
        try:
            self.values.release()
            if self._mm is not None:
                self._mm.close()
        except BufferError:  # a reader still holds a view (numpy); the map goes with it
            log.debug("generation table still referenced at close")
