"""The host arena: chunk files of fixed slots, and the one mmap code the daemon and clients share.

A layout's slots live in files named by ``chunk_path_template.format(chunk=c)``; slot ``s`` is
at ``(s % slots_per_chunk) * slot_bytes`` in chunk ``s // slots_per_chunk``. The daemon creates
the files; clients map them lazily, by slot, and pin them with ``cudaHostRegister`` when CUDA is
loaded in their process. No torch import here: CUDA is used only when the caller already has it.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArenaGeometry:
    """Where a layout's slots are; identical in the daemon and in every client."""

    slot_bytes: int
    slots_per_chunk: int
    max_slots: int
    chunk_path_template: str

    def __post_init__(self) -> None:
        if self.slot_bytes <= 0 or self.slots_per_chunk <= 0:
            raise ValueError(f"bad arena geometry: {self}")

    @property
    def chunk_file_bytes(self) -> int:
        return self.slot_bytes * self.slots_per_chunk

    def chunk_of(self, slot: int) -> int:
        return slot // self.slots_per_chunk

    def offset_of(self, slot: int) -> int:
        return (slot % self.slots_per_chunk) * self.slot_bytes

    def chunk_path(self, chunk: int) -> str:
        return self.chunk_path_template.format(chunk=chunk)


def chunk_path_template(arena_dir: str, namespace: str, layout_id: int) -> str:
    return os.path.join(arena_dir, f"kvd-{namespace}-L{layout_id}-C{{chunk}}")


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


def create_chunk_file(path: str, size: int, mode: int, gid: int | None) -> int:
    """Create (or keep, on a warm restart) one chunk file of ``size`` bytes with ``mode``;
    returns the size it had (0 when new)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, mode)
    try:
        os.fchmod(fd, mode)  # the umask must not widen or narrow what was configured
        if gid is not None:
            os.fchown(fd, -1, gid)
        found = os.fstat(fd).st_size
        if found != size:
            os.ftruncate(fd, size)
        return found
    finally:
        os.close(fd)


class ArenaMapping:
    """A process's mapping of one layout's chunk files; chunks are mapped on first use."""

    def __init__(self, geometry: ArenaGeometry) -> None:
        self.geometry = geometry
        self._maps: dict[int, mmap.mmap] = {}
        self._anchors: dict[int, ctypes.c_char] = {}  # keeps buffer addresses alive
        self._views: dict[int, memoryview] = {}
        self._inodes: dict[int, int] = {}
        self._cuda_registered: set[int] = set()
        self._want_cuda = False

    def _chunk(self, chunk: int) -> mmap.mmap:
        mm = self._maps.get(chunk)
        if mm is None:
            path = self.geometry.chunk_path(chunk)
            fd = os.open(path, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                if size < self.geometry.chunk_file_bytes:
                    raise ValueError(
                        f"arena chunk {path} has {size} bytes, expected "
                        f"{self.geometry.chunk_file_bytes}"
                    )
                mm = mmap.mmap(fd, self.geometry.chunk_file_bytes, mmap.MAP_SHARED)
                self._inodes[chunk] = os.fstat(fd).st_ino
            finally:
                os.close(fd)
            self._maps[chunk] = mm
            if self._want_cuda:
                self._cuda_register_chunk(chunk)
        return mm

    def chunk_view(self, chunk: int) -> memoryview:
        """The whole chunk as one view (cached: slicing it is cheap, mapping is not)."""
        view = self._views.get(chunk)
        if view is None:
            view = memoryview(self._chunk(chunk))
            self._views[chunk] = view
        return view

    def slot_view(self, slot: int) -> memoryview:
        """A writable view of the slot's bytes in the shared file."""
        self._check(slot)
        g = self.geometry
        start = g.offset_of(slot)
        return self.chunk_view(g.chunk_of(slot))[start : start + g.slot_bytes]

    def read(self, slot: int) -> bytes:
        return self.slot_view(slot).tobytes()

    def write(self, slot: int, data: bytes | bytearray | memoryview) -> None:
        if len(data) != self.geometry.slot_bytes:
            raise ValueError(f"slot data must be {self.geometry.slot_bytes} bytes, got {len(data)}")
        self.slot_view(slot)[:] = data

    def is_stale(self) -> bool:
        """True when a mapped chunk file was replaced (the daemon lost its arena and made new
        files): this mapping must be dropped and the engine must register again."""
        for chunk, inode in self._inodes.items():
            try:
                if os.stat(self.geometry.chunk_path(chunk)).st_ino != inode:
                    return True
            except FileNotFoundError:
                return True
        return False

    def address(self, slot: int) -> int:
        """The slot's base pointer in this process (for device copies)."""
        self._check(slot)
        g = self.geometry
        chunk = g.chunk_of(slot)
        anchor = self._anchors.get(chunk)
        if anchor is None:
            anchor = ctypes.c_char.from_buffer(self._chunk(chunk))
            self._anchors[chunk] = anchor
        return ctypes.addressof(anchor) + g.offset_of(slot)

    def register_cuda(self) -> bool:
        """Pin every mapped (and every later mapped) chunk with cudaHostRegister.

        Only when torch is already imported in this process and CUDA is available; returns
        whether pinning is active. Never imports torch itself.
        """
        torch: Any = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available():
            return False
        self._want_cuda = True
        for chunk in list(self._maps):
            self._cuda_register_chunk(chunk)
        return True

    def _cuda_register_chunk(self, chunk: int) -> None:
        if chunk in self._cuda_registered:
            return
        torch: Any = sys.modules["torch"]
        base = self.address(chunk * self.geometry.slots_per_chunk)
        err = torch.cuda.cudart().cudaHostRegister(base, self.geometry.chunk_file_bytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed for chunk {chunk}: error {int(err)}")
        self._cuda_registered.add(chunk)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.geometry.max_slots:
            raise IndexError(f"slot {slot} outside [0, {self.geometry.max_slots})")

    def close(self) -> None:
        torch: Any = sys.modules.get("torch")
        for chunk in list(self._cuda_registered):
            if torch is not None:
                torch.cuda.cudart().cudaHostUnregister(self.address(chunk * self.geometry.slots_per_chunk))
        self._cuda_registered.clear()
        self._anchors.clear()
        for view in self._views.values():
            try:
                view.release()
            except BufferError:
                log.debug("arena view still exported at close")
        self._views.clear()
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # a caller still holds a view; the map goes with it
                log.debug("arena chunk still referenced at close")
        self._maps.clear()
