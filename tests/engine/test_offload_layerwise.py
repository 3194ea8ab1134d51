"""Layer-by-layer loads from arena slots into KV blocks (engine.offload.layerwise).

On CPU each layer is copied when the step first waits for it (the rest by ``finish``); on CUDA
the copies run on a load stream in units of layers (halving toward the last), one event per
unit, by 2-D DMA where slots and block ids both come in runs and by a gather kernel through the
mapped arena otherwise."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.offload.copies import ArenaBlocks
from engine.offload.layer_plan import GroupLoad, GroupPlan, copy_units
from engine.offload.layerwise import LayerLoader
from offloadd.arena import ArenaGeometry, ArenaMapping, create_chunk_file

SHAPE = (3, 2, 4, 2, 8)  # layers, K/V, tokens, heads, dim
BLOCK_BYTES = 3 * 2 * 4 * 2 * 8 * 4


def _arena(root: str, device: torch.device, slots_per_chunk: int = 4, chunks: int = 2,
           shape: tuple[int, ...] = SHAPE) -> ArenaBlocks:
    block_bytes = 4 * int(torch.tensor(shape).prod())
    geometry = ArenaGeometry(block_bytes, slots_per_chunk, slots_per_chunk * chunks, os.path.join(root, "chunk-{chunk}"))
    for c in range(chunks):
        create_chunk_file(geometry.chunk_path(c), geometry.chunk_file_bytes, 0o600, None)
    return ArenaBlocks(ArenaMapping(geometry), shape, torch.float32, device)


@pytest.fixture
def arena(tmp_path: Path) -> ArenaBlocks:
    return _arena(str(tmp_path), torch.device("cpu"))


def _stored(arena: ArenaBlocks, ids: list[int], slots: list[int]) -> torch.Tensor:
    src = torch.randn(12, *SHAPE)
    arena.write(arena.gather(src, ids), slots)
    return src


def test_cpu_layers_are_copied_when_waited_for_and_the_rest_by_finish(arena: ArenaBlocks) -> None:
    ids, slots = [3, 1, 7, 2, 9], [6, 0, 5, 3, 1]  # both chunk files, out of order
    src = _stored(arena, ids, slots)
    kv = torch.zeros(12, *SHAPE)
    targets = [8, 4, 2, 6, 10]
    loader = LayerLoader(kv.device)
    loads = loader.new_step()
    loader.load([GroupLoad(0, arena, kv, targets, slots)], loads)
    assert not loads.empty
    assert torch.count_nonzero(kv) == 0  # nothing before the step asks
    loads.wait_layer(0, 1)
    assert torch.equal(kv[targets, 1], src[ids, 1])
    assert torch.count_nonzero(kv[:, 0]) == 0 and torch.count_nonzero(kv[:, 2]) == 0
    loads.wait_layer(1, 0)  # another group's layer: nothing of this group's
    assert torch.count_nonzero(kv[:, 0]) == 0
    assert loads.finish() is None  # CPU: nothing left in flight
    assert loads.empty and loads.copy_seconds > 0
    assert torch.equal(kv[targets], src[ids])
    untouched = [i for i in range(12) if i not in targets]
    assert torch.count_nonzero(kv[untouched]) == 0


def test_two_groups_and_two_loads_in_one_step(arena: ArenaBlocks, tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    other = _arena(str(tmp_path / "other"), torch.device("cpu"))
    src_a = _stored(arena, [1, 2, 3], [0, 1, 2])
    src_b = _stored(other, [4, 5], [7, 3])
    kv_a, kv_b = torch.zeros(12, *SHAPE), torch.zeros(12, *SHAPE)
    loader = LayerLoader(kv_a.device)
    loads = loader.new_step()
    loader.load([GroupLoad(0, arena, kv_a, [9, 10], [0, 1]), GroupLoad(1, other, kv_b, [2], [3])], loads)
    loader.load([GroupLoad(0, arena, kv_a, [11], [2])], loads)
    for layer in range(SHAPE[0]):
        loads.wait_layer(0, layer)
    assert torch.equal(kv_a[[9, 10, 11]], src_a[[1, 2, 3]])
    assert torch.count_nonzero(kv_b) == 0
    loads.finish()
    assert torch.equal(kv_b[2], src_b[5])


def test_bad_slots_raise_before_anything_is_copied(arena: ArenaBlocks) -> None:
    kv = torch.zeros(12, *SHAPE)
    loader = LayerLoader(kv.device)
    loads = loader.new_step()
    with pytest.raises(IndexError, match="slot 8 outside"):
        loader.load([GroupLoad(0, arena, kv, [1, 2], [0, 8])], loads)
    assert loads.empty
    with pytest.raises(ValueError, match="2 blocks but 1 slots"):
        loader.load([GroupLoad(0, arena, kv, [1, 2], [0])], loads)
    assert loads.empty


@pytest.mark.parametrize("layers", [1, 2, 3, 10, 16, 28])
def test_copy_units_halve_toward_a_last_unit_of_one_layer(layers: int) -> None:
    units = copy_units(layers)
    assert units[0][0] == 0 and units[-1] == (layers - 1, layers)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(units))  # in order, no gap
    sizes = [b - a for a, b in units]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == max(1, layers // 2)
    assert copy_units(16) == [(0, 8), (8, 12), (12, 14), (14, 15), (15, 16)]
    assert copy_units(layers, halving=False) == [(li, li + 1) for li in range(layers)]


def test_a_unit_of_several_layers_copies_those_layers_only(arena: ArenaBlocks) -> None:
    ids, slots = [3, 1, 7], [6, 0, 5]
    src = _stored(arena, ids, slots)
    kv = torch.zeros(12, *SHAPE)
    plan = GroupPlan(GroupLoad(0, arena, kv, [8, 4, 2], slots), None)
    assert plan.units == [(0, 1), (1, 2), (2, 3)] and not plan.dma  # CPU: the gather path
    plan.copy_layers(1, 3)
    assert torch.equal(kv[[8, 4, 2], 1:], src[ids, 1:])
    assert torch.count_nonzero(kv[:, 0]) == 0
    assert torch.count_nonzero(kv[[i for i in range(12) if i not in (8, 4, 2)]]) == 0


@pytest.fixture
def shm() -> Iterator[str]:
    root = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield root
    shutil.rmtree(root, ignore_errors=True)


GPU_SHAPE = (10, 2, 4, 2, 8)  # more layers than are issued ahead of the step's waits


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["runs", "scattered", "runs-across-chunks"])
@pytest.mark.parametrize("waits", ["every-layer", "three-then-finish"])
@pytest.mark.parametrize("halving", [True, False])
def test_cuda_layer_events_order_each_layer(shm: str, kind: str, waits: str, halving: bool) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    arena = _arena(shm, dev, slots_per_chunk=16, chunks=2, shape=GPU_SHAPE)
    src = torch.randn(64, *GPU_SHAPE, device=dev)
    n = 12
    ids = list(range(40, 40 + n))
    slots = {"runs": list(range(2, 2 + n)), "runs-across-chunks": list(range(10, 10 + n)),
             "scattered": [31, 0, 14, 7, 22, 3, 16, 2, 26, 27, 9, 5]}[kind]
    arena.write(arena.gather(src, ids), slots)
    torch.cuda.synchronize()
    kv = torch.zeros_like(src)
    targets = list(range(5, 5 + n)) if kind != "scattered" else [1, 4, 6, 10, 12, 14, 20, 39, 24, 25, 26, 50]
    loader = LayerLoader(dev, halving=halving)
    loads = loader.new_step()
    loader.load([GroupLoad(0, arena, kv, targets, slots)], loads)
    # Each layer as the step would see it: a stream that waited for that layer only (the
    # later layers are issued from these waits, or by finish for those never waited for).
    seen = []
    for layer in range(GPU_SHAPE[0] if waits == "every-layer" else 3):
        loads.wait_layer(0, layer)
        seen.append(kv[targets, layer].clone())
    done = loads.finish()
    assert done is not None and loads.empty
    done.synchronize()
    torch.cuda.synchronize()
    for layer, got in enumerate(seen):
        assert torch.equal(got, src[ids, layer])
    assert torch.equal(kv[targets], src[ids])
    untouched = [i for i in range(64) if i not in targets]
    assert torch.count_nonzero(kv[untouched]) == 0
    # Runs go by 2-D DMA (one copy per run and unit), scattered slots by the gather kernel.
    assert loader.issued == ({"kernel": 1} if kind == "scattered" else {"dma": 1})
    arena.close()
    arena.mapping.close()


@pytest.mark.gpu
def test_cuda_two_loads_two_groups_in_one_step_then_the_next_step(shm: str) -> None:
    """Two requests' loads in one step (the second added after the first issued its first
    layers), one group by DMA and one by the gather kernel, the step waiting on every layer of
    both groups; then a second step on the same loader (its per-layer events recorded again)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    os.mkdir(os.path.join(shm, "a"))
    os.mkdir(os.path.join(shm, "b"))
    arena_a = _arena(os.path.join(shm, "a"), dev, slots_per_chunk=16, chunks=2, shape=GPU_SHAPE)
    arena_b = _arena(os.path.join(shm, "b"), dev, slots_per_chunk=16, chunks=2, shape=GPU_SHAPE)
    src = torch.randn(64, *GPU_SHAPE, device=dev)
    arena_a.write(arena_a.gather(src, list(range(10, 22))), list(range(0, 12)))  # runs
    arena_b.write(arena_b.gather(src, [40, 41, 42, 43]), [30, 3, 17, 9])  # scattered
    torch.cuda.synchronize()
    kv_a, kv_b = torch.zeros_like(src), torch.zeros_like(src)
    loader = LayerLoader(dev)
    loads = loader.new_step()
    loader.load([GroupLoad(0, arena_a, kv_a, list(range(30, 38)), list(range(0, 8))),
                 GroupLoad(1, arena_b, kv_b, [50, 51], [30, 3])], loads)
    loader.load([GroupLoad(0, arena_a, kv_a, list(range(45, 49)), list(range(8, 12))),
                 GroupLoad(1, arena_b, kv_b, [52, 53], [17, 9])], loads)
    seen_a, seen_b = [], []
    for layer in range(GPU_SHAPE[0]):  # a hybrid model's layers alternate between the groups
        loads.wait_layer(0, layer)
        seen_a.append(kv_a[[*range(30, 38), *range(45, 49)], layer].clone())
        loads.wait_layer(1, layer)
        seen_b.append(kv_b[50:54, layer].clone())
    done = loads.finish()
    assert done is not None
    done.synchronize()
    for layer in range(GPU_SHAPE[0]):
        assert torch.equal(seen_a[layer], src[10:22, layer])
        assert torch.equal(seen_b[layer], src[40:44, layer])
    assert loader.issued == {"dma": 2, "kernel": 2}
    # The next step: the same events recorded again, new blocks.
    loader.load([GroupLoad(0, arena_a, kv_a, list(range(2, 14)), list(range(0, 12)))], loads)
    for layer in range(GPU_SHAPE[0]):
        loads.wait_layer(0, layer)
    assert loads.finish() is not None
    torch.cuda.synchronize()
    assert torch.equal(kv_a[2:14], src[10:22])
    for arena in (arena_a, arena_b):
        arena.close()
        arena.mapping.close()
