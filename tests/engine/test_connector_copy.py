"""Batched copies between a block tensor and arena chunk files (engine.offload_copy), on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.offload_copy import ArenaBlocks, slot_runs
from offloadd.arena import ArenaGeometry, ArenaMapping, create_chunk_file

SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, tokens, heads, dim
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4


@pytest.fixture
def arena(tmp_path: Path) -> ArenaBlocks:
    geometry = ArenaGeometry(BLOCK_BYTES, 4, 8, str(tmp_path / "chunk-{chunk}"))
    for c in range(2):
        create_chunk_file(geometry.chunk_path(c), geometry.chunk_file_bytes, 0o600, None)
    return ArenaBlocks(ArenaMapping(geometry), SHAPE, torch.float32, torch.device("cpu"))


def test_scattered_store_and_load_across_chunks(arena: ArenaBlocks) -> None:
    kv = torch.randn(10, *SHAPE)
    ids, slots = [3, 1, 7, 2, 9], [6, 0, 5, 3, 1]  # both chunk files, out of order
    arena.write(arena.gather(kv, ids), slots)
    for b, s in zip(ids, slots, strict=True):  # the bytes sit where offloadd will read them
        assert arena.mapping.read(s) == kv[b].numpy().tobytes()
    out = torch.zeros_like(kv)
    targets = [8, 4, 2, 6, 1]
    arena.read(out, targets, slots)
    for b, t in zip(ids, targets, strict=True):
        assert torch.equal(out[t], kv[b])
    untouched = [i for i in range(10) if i not in targets]
    assert torch.count_nonzero(out[untouched]) == 0


def test_gather_is_a_snapshot(arena: ArenaBlocks) -> None:
    kv = torch.randn(4, *SHAPE)
    staged = arena.gather(kv, [1, 2])
    want = kv[[1, 2]].clone()
    kv[1:3] = 0  # the engine reuses the blocks right after the step
    arena.write(staged, [4, 5])
    assert arena.mapping.read(4) == want[0].numpy().tobytes()


def test_bad_input_is_refused(arena: ArenaBlocks, tmp_path: Path) -> None:
    kv = torch.randn(4, *SHAPE)
    with pytest.raises(IndexError, match="slot 8 outside"):
        arena.read(kv, [1], [8])
    with pytest.raises(ValueError, match="2 blocks but 1 slots"):
        arena.read(kv, [1, 2], [0])
    with pytest.raises(ValueError, match="arena slot is"):
        ArenaBlocks(arena.mapping, (1, 2, 3), torch.float32, torch.device("cpu"))


def test_slot_runs() -> None:
    assert slot_runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert slot_runs([]) == []


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["auto", "kernel", "memcpy"])
@pytest.mark.parametrize("contiguous", [False, True])
def test_cuda_copy_paths(mode: str, contiguous: bool) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import os
    import shutil
    import tempfile

    shm = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        geometry = ArenaGeometry(BLOCK_BYTES, 16, 32, os.path.join(shm, "chunk-{chunk}"))
        for c in range(2):
            create_chunk_file(geometry.chunk_path(c), geometry.chunk_file_bytes, 0o600, None)
        dev = torch.device("cuda")
        arena = ArenaBlocks(ArenaMapping(geometry), SHAPE, torch.float32, dev, mode)
        kv = torch.randn(40, *SHAPE, device=dev)
        ids = [5, 3, 17, 9, 30, 2, 11, 8]
        slots = list(range(12, 20)) if contiguous else [31, 0, 14, 7, 22, 3, 16, 9]
        arena.write(arena.gather(kv, ids), slots)
        torch.cuda.synchronize()
        for b, s in zip(ids, slots, strict=True):
            assert arena.mapping.read(s) == kv[b].cpu().numpy().tobytes()
        out = torch.zeros_like(kv)
        targets = [1, 4, 6, 10, 12, 14, 20, 39]
        arena.read(out, targets, slots)
        torch.cuda.synchronize()
        for b, t in zip(ids, targets, strict=True):
            assert torch.equal(out[t], kv[b])
        arena.close()
        arena.mapping.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
