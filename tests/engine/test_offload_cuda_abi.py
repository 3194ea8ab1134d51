"""The ctypes prototypes of engine.offload.cuda_runtime against a C stand-in for libcudart.

cudaMemcpyBatchAsync changed its argument list between the CUDA 12.8/12.9 runtime (with
``failIdx``) and 13.x (without); a wrong prototype corrupts the stack instead of failing. With no
GPU here, a small C library with the real prototypes (built with the system C compiler, one per
runtime version) checks every argument the engine passes and copies with memcpy, so the calls
are checked byte for byte. On a CUDA machine the gpu-marked copy tests run the real runtime.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from engine.offload.cuda_runtime import (
    BatchUnsupportedError,
    CudaMemcpyAttributes,
    DmaCopier,
    copy_table,
    find_cuda_batch_memcpy,
    find_cuda_memcpy,
    issue_copies,
    pair_runs,
    runtime_version,
)

FAKE_CUDART = r"""
#include <stddef.h>
#include <string.h>

struct loc { int type; int id; };
struct attrs { int srcAccessOrder; struct loc srcLocHint; struct loc dstLocHint; unsigned int flags; };

unsigned int last_flags = 99;
void *last_stream = 0;
size_t calls = 0;
int force_error = 0;

int cudaRuntimeGetVersion(int *v) { *v = RUNTIME; return 0; }

static int batch(void **dsts, void **srcs, size_t *sizes, size_t count, struct attrs *a,
                 size_t *idx, size_t n_attrs, void *stream) {
    if (sizeof(struct attrs) != 24 || a == 0 || idx == 0 || n_attrs != 1 || idx[0] != 0) return 1;
    if (a->srcAccessOrder != 1 || a->srcLocHint.type != 0 || a->dstLocHint.type != 0) return 1;
    if (stream == 0 || count == 0) return 1;
    if (force_error) return force_error;
    for (size_t i = 0; i < count; i++) memcpy(dsts[i], srcs[i], sizes[i]);
    last_flags = a->flags;
    last_stream = stream;
    calls++;
    return 0;
}

#if RUNTIME >= 13000
int cudaMemcpyBatchAsync(void **dsts, void **srcs, size_t *sizes, size_t count, struct attrs *a,
                         size_t *idx, size_t n_attrs, void *stream) {
    return batch(dsts, srcs, sizes, count, a, idx, n_attrs, stream);
}
#else
int cudaMemcpyBatchAsync(void **dsts, void **srcs, size_t *sizes, size_t count, struct attrs *a,
                         size_t *idx, size_t n_attrs, size_t *fail_idx, void *stream) {
    if (fail_idx == 0) return 1;
    *fail_idx = (size_t)-1;
    return batch(dsts, srcs, sizes, count, a, idx, n_attrs, stream);
}
#endif
"""


def _build(tmp_path: Path, runtime: int) -> ctypes.CDLL:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler")
    c = tmp_path / "fake_cudart.c"
    c.write_text(FAKE_CUDART)
    lib = tmp_path / f"libfakecudart{runtime}.so"
    subprocess.run([cc, "-shared", "-fPIC", f"-DRUNTIME={runtime}", "-o", str(lib), str(c)], check=True)
    return ctypes.CDLL(str(lib))


def test_attributes_struct_is_24_bytes() -> None:
    assert ctypes.sizeof(CudaMemcpyAttributes) == 24


@pytest.mark.parametrize("runtime", [12080, 12090, 13000, 13050])
@pytest.mark.parametrize("flags", [0, 1])
def test_batch_prototype_by_runtime_version(tmp_path: Path, runtime: int, flags: int) -> None:
    lib = _build(tmp_path, runtime)
    assert runtime_version(lib) == runtime
    batch = find_cuda_batch_memcpy(lib, flags)
    assert batch is not None and batch.with_fail_idx == (runtime < 13000)
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    # Three copies: src[0:8] -> dst[40:48], src[8:24] -> dst[0:16], src[60:64] -> dst[20:24].
    dsts = torch.tensor([40, 0, 20]) + dst.data_ptr()
    srcs = torch.tensor([0, 8, 60]) + src.data_ptr()
    sizes = torch.tensor([8, 16, 4])
    issue_copies(dsts, srcs, sizes, [0x1234], None, batch)
    want = torch.zeros(64, dtype=torch.uint8)
    want[40:48], want[0:16], want[20:24] = src[0:8], src[8:24], src[60:64]
    assert torch.equal(dst, want)
    assert ctypes.c_uint.in_dll(lib, "last_flags").value == flags
    assert ctypes.c_void_p.in_dll(lib, "last_stream").value == 0x1234
    assert ctypes.c_size_t.in_dll(lib, "calls").value == 1


def test_batch_splits_over_streams(tmp_path: Path) -> None:
    lib = _build(tmp_path, 13000)
    batch = find_cuda_batch_memcpy(lib)
    assert batch is not None
    src = torch.arange(100, dtype=torch.uint8)
    dst = torch.zeros(100, dtype=torch.uint8)
    offsets = torch.arange(0, 100, 10)
    # 10 copies of 10 bytes in reverse order, over 3 streams: 4 + 4 + 2 copies, 3 calls.
    issue_copies(dst.data_ptr() + offsets.flip(0), src.data_ptr() + offsets, torch.full((10,), 10),
                 [11, 22, 33], None, batch)
    assert torch.equal(dst, src.view(10, 10).flip(0).flatten())
    assert ctypes.c_size_t.in_dll(lib, "calls").value == 3
    assert ctypes.c_void_p.in_dll(lib, "last_stream").value == 33


def test_batch_refuses_the_legacy_stream_and_reports_errors(tmp_path: Path) -> None:
    batch = find_cuda_batch_memcpy(_build(tmp_path, 12080))
    assert batch is not None
    buf = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="legacy NULL stream"):
        batch(buf.data_ptr(), buf.data_ptr(), buf.data_ptr(), 1, 0)
    with pytest.raises(RuntimeError, match="cudaMemcpyBatchAsync of 0 copies failed: error 1"):
        batch(buf.data_ptr(), buf.data_ptr(), buf.data_ptr(), 0, 7)


def test_a_driver_without_batch_support_is_told_apart(tmp_path: Path) -> None:
    lib = _build(tmp_path, 12090)
    batch = find_cuda_batch_memcpy(lib)
    assert batch is not None
    buf = torch.zeros(8, dtype=torch.uint8)
    ptrs = torch.tensor([buf.data_ptr()])
    for code in (35, 36, 801):  # insufficient driver, call requires newer driver, not supported
        ctypes.c_int.in_dll(lib, "force_error").value = code
        with pytest.raises(BatchUnsupportedError, match=f"not supported here: error {code}"):
            batch(ptrs.data_ptr(), ptrs.data_ptr(), torch.tensor([8]).data_ptr(), 1, 7)
    ctypes.c_int.in_dll(lib, "force_error").value = 700  # a real failure stays a plain error
    with pytest.raises(RuntimeError, match="error 700") as err:
        batch(ptrs.data_ptr(), ptrs.data_ptr(), torch.tensor([8]).data_ptr(), 1, 7)
    assert not isinstance(err.value, BatchUnsupportedError)


def test_old_runtime_or_no_runtime_has_no_batch(tmp_path: Path) -> None:
    assert find_cuda_batch_memcpy(_build(tmp_path, 12060)) is None  # symbol there, runtime too old
    assert find_cuda_memcpy(_build(tmp_path, 13000)) is None  # the stand-in has no cudaMemcpyAsync


@pytest.mark.parametrize("to_host", [True, False])
def test_run_addresses_move_the_right_rows(tmp_path: Path, to_host: bool) -> None:
    """The address table of a DMA copy (what DmaCopier hands the runtime), run through the batch
    binding on CPU tensors, against the torch fallback of the same copy."""
    batch = find_cuda_batch_memcpy(_build(tmp_path, 13000))
    assert batch is not None
    host_rows, dev_rows = torch.tensor([2, 3, 4, 7, 9, 10]), torch.tensor([5, 6, 0, 1, 3, 4])
    results = []
    for use_batch in (True, False):
        host = torch.arange(12 * 6, dtype=torch.int64).view(12, 6)
        dev = -torch.arange(8 * 6, dtype=torch.int64).view(8, 6)
        if use_batch:
            table = copy_table(host, dev, *pair_runs(host_rows, dev_rows), to_host)
            issue_copies(*table, [5], None, batch)
        else:
            DmaCopier(torch.device("cpu"), 1, None, None).copy(host, dev, host_rows, dev_rows, to_host)
        results.append((host, dev))
    (host, dev), (want_host, want_dev) = results
    assert torch.equal(host, want_host) and torch.equal(dev, want_dev)
    src, dst = (dev, host) if to_host else (host, dev)
    src_rows, dst_rows = (dev_rows, host_rows) if to_host else (host_rows, dev_rows)
    assert torch.equal(dst[dst_rows], src[src_rows])
