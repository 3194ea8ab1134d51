"""The few CUDA runtime pieces torch does not expose: a raw async memcpy, and a device tensor
over host memory that was registered (mapped) with cudaHostRegister."""

from __future__ import annotations

import ctypes
from typing import Any

CUDA_HOST_REGISTER_PORTABLE_MAPPED = 1 | 2
CUDA_MEMCPY_DEFAULT = 4


def find_cuda_memcpy() -> Any | None:
    """``cudaMemcpyAsync`` of the libcudart this process already loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).cudaMemcpyAsync
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return fn
    return None


class CudaArray:
    """Exposes a device-visible pointer to ``torch.as_tensor`` (CUDA array interface v3)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }
