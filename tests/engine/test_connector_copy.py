"""Batched copies between a block tensor and arena chunk files (engine.offload.copies), on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.offload.config import COPY_MODES
from engine.offload.copies import ArenaBlocks
from engine.offload.cuda_runtime import pair_runs
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


def test_pair_runs_break_where_either_side_jumps() -> None:
    host = torch.tensor([2, 3, 4, 5, 9, 10, 11])
    dev = torch.tensor([0, 1, 5, 6, 7, 8, 3])
    first_h, first_d, length = pair_runs(host, dev)
    assert first_h.tolist() == [2, 4, 9, 11]
    assert first_d.tolist() == [0, 5, 7, 3]
    assert length.tolist() == [2, 2, 2, 1]
    assert [t.tolist() for t in pair_runs(torch.tensor([7]), torch.tensor([0]))] == [[7], [0], [1]]


@pytest.mark.parametrize("mode", COPY_MODES)
def test_every_copy_mode_moves_the_same_bytes_on_cpu(tmp_path: Path, mode: str) -> None:
    geometry = ArenaGeometry(BLOCK_BYTES, 4, 8, str(tmp_path / "chunk-{chunk}"))
    for c in range(2):
        create_chunk_file(geometry.chunk_path(c), geometry.chunk_file_bytes, 0o600, None)
    arena = ArenaBlocks(ArenaMapping(geometry), SHAPE, torch.float32, torch.device("cpu"), mode,
                        num_dma_streams=2, dma_share=0.5)
    kv = torch.randn(10, *SHAPE)
    ids, slots = [3, 1, 7, 2, 9, 0], [6, 0, 5, 3, 1, 2]
    arena.write(arena.gather(kv, ids), slots)
    assert [arena.mapping.read(s) for s in slots] == [kv[b].numpy().tobytes() for b in ids]
    out = torch.zeros_like(kv)
    arena.read(out, [9, 8, 7, 6, 5, 4], slots)
    assert torch.equal(out[[9, 8, 7, 6, 5, 4]], kv[ids])
    assert torch.count_nonzero(out[:4]) == 0


def test_bad_copy_settings_are_refused(arena: ArenaBlocks) -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="copy_mode must be one of auto, kernel, memcpy, batch, mixed; got 'dma'"):
        ArenaBlocks(arena.mapping, SHAPE, torch.float32, cpu, "dma")
    with pytest.raises(ValueError, match="num_dma_streams must be >= 1, got 0"):
        ArenaBlocks(arena.mapping, SHAPE, torch.float32, cpu, "memcpy", num_dma_streams=0)
    with pytest.raises(ValueError, match=r"dma_share must be within \[0, 1\], got 1.5"):
        ArenaBlocks(arena.mapping, SHAPE, torch.float32, cpu, "mixed", dma_share=1.5)


# Every CUDA path, with the knobs that change which code runs: DMA over 2 streams (memcpy: round
# robin; batch: one batch call per stream), mixed shares that split the call between DMA and the
# kernel (0.5, 0.75) or send it all one way (0.0, 1.0), and batch with the overlap flag.
CUDA_CASES = [
    ("auto", {}), ("kernel", {}), ("memcpy", {}), ("memcpy", {"num_dma_streams": 2}),
    ("batch", {}), ("batch", {"num_dma_streams": 2}), ("batch", {"batch_flags": 1}),
    ("mixed", {}), ("mixed", {"dma_share": 0.5}), ("mixed", {"dma_share": 0.0}),
    ("mixed", {"dma_share": 1.0}), ("mixed", {"num_dma_streams": 2}),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("mode", "knobs"), CUDA_CASES, ids=[f"{m}-{k}" for m, k in CUDA_CASES])
@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("side_stream", [False, True])
def test_cuda_copy_paths(mode: str, knobs: dict[str, float], contiguous: bool, side_stream: bool) -> None:
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
        arena = ArenaBlocks(ArenaMapping(geometry), SHAPE, torch.float32, dev, mode, **knobs)  # type: ignore[arg-type]
        kv = torch.randn(40, *SHAPE, device=dev)
        ids = [5, 3, 17, 9, 30, 2, 11, 8, 21, 22, 23]
        # runs: 12..15 | 16..22 across the chunk boundary; scattered: both chunks, some slots
        # adjacent (2, 3) with their rows not, some adjacent with their rows too (26, 27).
        slots = list(range(12, 23)) if contiguous else [31, 0, 14, 7, 22, 3, 16, 2, 26, 27, 9]
        # On the legacy default stream (cuda_stream 0) and on a side stream: the DMA streams
        # must order themselves after either one.
        stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())  # kv was made on the default stream
        with torch.cuda.stream(stream):
            arena.write(arena.gather(kv, ids), slots)
        torch.cuda.synchronize()
        for b, s in zip(ids, slots, strict=True):
            assert arena.mapping.read(s) == kv[b].cpu().numpy().tobytes()
        out = torch.zeros_like(kv)
        targets = [1, 4, 6, 10, 12, 14, 20, 39, 24, 25, 26]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            arena.read(out, targets, slots)
        torch.cuda.synchronize()
        for b, t in zip(ids, targets, strict=True):
            assert torch.equal(out[t], kv[b])
        untouched = [i for i in range(40) if i not in targets]
        assert torch.count_nonzero(out[untouched]) == 0
        arena.close()
        arena.mapping.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
