"""The few CUDA runtime pieces torch does not expose: raw async memcpys (one call per copy, or one
``cudaMemcpyBatchAsync`` for many), the side streams they run on, and a device tensor over host
memory that was registered (mapped) with cudaHostRegister.

The runtime is the libcudart this process already loaded (torch's), reached through ctypes."""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch
from torch import Tensor

from engine.errors import EngineError

CUDA_HOST_REGISTER_PORTABLE_MAPPED = 1 | 2
CUDA_MEMCPY_DEFAULT = 4
CUDA_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CUDA_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
BATCH_MIN_RUNTIME = 12080  # cudaMemcpyBatchAsync appeared in CUDA 12.8
BATCH_NO_FAIL_IDX_RUNTIME = 13000  # CUDA 13 dropped its failIdx argument
# cudaErrorInsufficientDriver, cudaErrorCallRequiresNewerDriver, cudaErrorNotSupported: the
# runtime has the call but the driver cannot do it (minor-version compatibility).
BATCH_UNSUPPORTED_ERRORS = frozenset({35, 36, 801})

log = logging.getLogger(__name__)


class BatchUnsupportedError(EngineError, RuntimeError):
    """cudaMemcpyBatchAsync exists but this driver cannot run it; nothing was enqueued."""


class CudaMemLocation(ctypes.Structure):
    """``struct cudaMemLocation { enum cudaMemLocationType type; int id; }`` (CUDA 13 makes ``id``
    a 4-byte union; same layout)."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CudaMemcpyAttributes(ctypes.Structure):
    """``struct cudaMemcpyAttributes`` of driver_types.h (CUDA 12.8 and 13.x)."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", CudaMemLocation),
        ("dstLocHint", CudaMemLocation),
        ("flags", ctypes.c_uint),
    ]


assert ctypes.sizeof(CudaMemcpyAttributes) == 24, "cudaMemcpyAttributes must be 24 bytes"


def loaded_cudart() -> ctypes.CDLL | None:
    """The libcudart already mapped into this process, or None (never loads another one)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def find_cuda_memcpy(lib: ctypes.CDLL | None = None) -> Any | None:
    """``cudaMemcpyAsync`` of the loaded libcudart (torch's), or None."""
    lib = lib if lib is not None else loaded_cudart()
    fn = getattr(lib, "cudaMemcpyAsync", None) if lib is not None else None
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def find_cuda_memcpy_2d(lib: ctypes.CDLL | None = None) -> Any | None:
    """``cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream)`` of the loaded
    libcudart (torch's), or None: ``height`` rows of ``width`` bytes, pitched on each side."""
    lib = lib if lib is not None else loaded_cudart()
    fn = getattr(lib, "cudaMemcpy2DAsync", None) if lib is not None else None
    if fn is None:
        return None
    size = ctypes.c_size_t
    fn.argtypes = [ctypes.c_void_p, size, ctypes.c_void_p, size, size, size, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def runtime_version(lib: ctypes.CDLL) -> int:
    """``cudaRuntimeGetVersion`` (e.g. 12080, 13000), or 0 when it cannot be asked."""
    fn = getattr(lib, "cudaRuntimeGetVersion", None)
    if fn is None:
        return 0
    version = ctypes.c_int(0)
    fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
    fn.restype = ctypes.c_int
    return version.value if fn(ctypes.byref(version)) == 0 else 0


class BatchMemcpy:
    """``cudaMemcpyBatchAsync`` with one attribute entry for every copy: stream-ordered source
    access, no location hints (pinned/registered host and device memory need none).

    Prototype by runtime version (from the 12.8 and 13.x cuda_runtime_api.h):
    ``(void **dsts, void **srcs, size_t *sizes, size_t count, cudaMemcpyAttributes *attrs,
    size_t *attrsIdxs, size_t numAttrs, [size_t *failIdx,] cudaStream_t stream)``, with failIdx
    only before CUDA 13."""

    def __init__(self, fn: Any, version: int, flags: int = 0) -> None:
        self.version = version
        self.with_fail_idx = version < BATCH_NO_FAIL_IDX_RUNTIME
        self._attrs = CudaMemcpyAttributes(srcAccessOrder=CUDA_MEMCPY_SRC_ACCESS_ORDER_STREAM, flags=flags)
        self._attrs_idx = (ctypes.c_size_t * 1)(0)
        self._fail_idx = ctypes.c_size_t(0)
        p, size = ctypes.c_void_p, ctypes.c_size_t
        head = [p, p, p, size, ctypes.POINTER(CudaMemcpyAttributes), ctypes.POINTER(ctypes.c_size_t), size]
        fn.argtypes = [*head, ctypes.POINTER(ctypes.c_size_t), p] if self.with_fail_idx else [*head, p]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, dsts: int, srcs: int, sizes: int, count: int, stream: int) -> None:
        """Enqueue ``count`` copies; the three arguments are addresses of host arrays of
        ``count`` 64-bit values (read during the call). ``stream`` must not be the legacy 0."""
        if stream == 0:
            raise ValueError("cudaMemcpyBatchAsync refuses the legacy NULL stream")
        args: list[Any] = [dsts, srcs, sizes, count, ctypes.byref(self._attrs), self._attrs_idx, 1]
        if self.with_fail_idx:
            args.append(ctypes.byref(self._fail_idx))
        err = self._fn(*args, stream)
        if err in BATCH_UNSUPPORTED_ERRORS:
            raise BatchUnsupportedError(f"cudaMemcpyBatchAsync is not supported here: error {err}")
        if err != 0:
            at = f" (copy {self._fail_idx.value})" if self.with_fail_idx else ""
            raise RuntimeError(f"cudaMemcpyBatchAsync of {count} copies failed: error {err}{at}")


def find_cuda_batch_memcpy(lib: ctypes.CDLL | None = None, flags: int = 0) -> BatchMemcpy | None:
    """``cudaMemcpyBatchAsync`` of the loaded libcudart when its runtime is >= 12.8, else None."""
    lib = lib if lib is not None else loaded_cudart()
    if lib is None:
        return None
    fn = getattr(lib, "cudaMemcpyBatchAsync", None)
    version = runtime_version(lib)
    if fn is None or version < BATCH_MIN_RUNTIME:
        return None
    return BatchMemcpy(fn, version, flags)


def pair_runs(host_rows: Tensor, dev_rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Runs where both the host rows and the device rows go up by one, with vector ops:
    ``(first host row, first device row, length)`` as int64 tensors."""
    n = len(host_rows)
    brk = torch.ones(n, dtype=torch.bool)
    if n > 1:
        brk[1:] = (host_rows.diff() != 1) | (dev_rows.diff() != 1)
    starts = brk.nonzero().flatten()
    length = torch.diff(starts, append=torch.tensor([n]))
    return host_rows[starts], dev_rows[starts], length


def copy_table(host: Tensor, dev: Tensor, first_h: Tensor, first_d: Tensor, length: Tensor,
               to_host: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Destination addresses, source addresses and byte counts of the runs (int64 tensors)."""
    row_bytes = host.shape[1] * host.element_size()
    h_ptr = first_h * row_bytes + host.data_ptr()
    d_ptr = first_d * row_bytes + dev.data_ptr()
    dst, src = (h_ptr, d_ptr) if to_host else (d_ptr, h_ptr)
    return dst, src, length * row_bytes


class DmaCopier:
    """DMA copies between rows of a registered host tensor and rows of a device tensor, one per
    run of rows that follow on both sides, on side streams.

    The side streams start after the work enqueued so far on the current stream, and
    :meth:`join` makes the current stream wait for all of them; several streams hide each copy's
    fixed gap behind another's bytes. Callers allocate every tensor the copies touch on the
    current stream and keep it referenced until the join, so the caching allocator needs no
    ``record_stream``. Without libcudart the copies are tensor ``copy_`` on the current stream."""

    def __init__(self, device: torch.device, num_streams: int, memcpy: Any | None,
                 batch: BatchMemcpy | None) -> None:
        self.device = device
        self.num_streams = num_streams
        self.memcpy = memcpy
        self.batch = batch
        self._streams: list[torch.cuda.Stream] = []

    def copy(self, host: Tensor, dev: Tensor, host_rows: Tensor, dev_rows: Tensor, to_host: bool) -> None:
        """Enqueue ``host[host_rows[i]] <-> dev[dev_rows[i]]`` (2-D contiguous tensors, rows of
        the same size); call :meth:`join` after enqueuing the rest of the step."""
        first_h, first_d, length = pair_runs(host_rows, dev_rows)
        if self.memcpy is None and self.batch is None:
            for h, d, n in zip(first_h.tolist(), first_d.tolist(), length.tolist(), strict=True):
                if to_host:
                    host[h : h + n].copy_(dev[d : d + n], non_blocking=True)
                else:
                    dev[d : d + n].copy_(host[h : h + n], non_blocking=True)
            return
        if not self._streams:
            self._streams = [torch.cuda.Stream(self.device) for _ in range(self.num_streams)]
        ready = torch.cuda.current_stream(self.device).record_event()
        for st in self._streams:
            st.wait_event(ready)
        dst, src, sizes = copy_table(host, dev, first_h, first_d, length, to_host)
        streams = [int(st.cuda_stream) for st in self._streams]
        try:
            issue_copies(dst, src, sizes, streams, self.memcpy, self.batch)
        except BatchUnsupportedError as e:
            if self.memcpy is None:
                raise
            # Copies already enqueued by an earlier stream's batch are repeated: same bytes.
            log.warning("%s: DMA copies fall back to one cudaMemcpyAsync per run", e)
            self.batch = None
            issue_copies(dst, src, sizes, streams, self.memcpy, None)

    def join(self) -> None:
        current = torch.cuda.current_stream(self.device)
        for st in self._streams:
            current.wait_stream(st)


def issue_copies(dsts: Tensor, srcs: Tensor, sizes: Tensor, streams: list[int],
                 memcpy: Any | None, batch: BatchMemcpy | None) -> None:
    """Copy ``sizes[i]`` bytes from address ``srcs[i]`` to ``dsts[i]`` (CPU int64 tensors):
    with ``batch``, one cudaMemcpyBatchAsync per stream over a contiguous share of the copies;
    else one cudaMemcpyAsync per copy, round-robin over the streams."""
    count = len(sizes)
    if batch is not None:
        table = torch.stack((dsts, srcs, sizes)).to(torch.int64).contiguous()
        base, step = table.data_ptr(), table.element_size()
        per = -(-count // len(streams))
        for i, stream in enumerate(streams):
            a = i * per
            if a >= count:
                break
            n = min(per, count - a)
            batch(base + a * step, base + (count + a) * step, base + (2 * count + a) * step, n, stream)
        return
    if memcpy is None:
        raise RuntimeError("no cudaMemcpyAsync in this process")
    handles = [ctypes.c_void_p(s) for s in streams]
    for i, (d, s, n) in enumerate(zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True)):
        err = memcpy(d, s, n, CUDA_MEMCPY_DEFAULT, handles[i % len(handles)])
        if err != 0:
            raise RuntimeError(f"cudaMemcpyAsync failed: error {err}")


class CudaArray:
    """Exposes a device-visible pointer to ``torch.as_tensor`` (CUDA array interface v3)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }
