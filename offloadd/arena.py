"""The host arena: chunk files of fixed slots, and the one mmap code the daemon and clients share
(each slot's servable generation is published beside them: offloadd.slot_generations).

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
