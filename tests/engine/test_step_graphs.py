"""The padded grid layout of small steps (engine.step_graphs) against transformers' logits.

On CPU the grid runs eagerly (``capture=False``): the same inputs, masks and padding the CUDA
graphs replay; tests/engine/test_cuda.py checks capture and replay on a GPU. Covered: chunked
prefill, prefix hits, decodes, a batch of unequal requests (padded rows and query slots), a
sliding window (hybrid model), block sizes whose key grid is and is not a multiple of 64, and
the fall-back to the eager runner for steps too large for a grid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.grid_buffers import GridRow, GridShape
from engine.llm import LLM
from engine.step_graphs import StepGraphs
from tests.engine.hf_reference import GREEDY, check_logits, prompt_ids


def _with_grid(llm: LLM, max_tokens: int = 512) -> StepGraphs:
    e = llm.engine
    graphs = StepGraphs(e.model, e.kv_groups, e.runner.layer_slots, e.device, capture=False, max_tokens=max_tokens)
    e.runner.graphs = graphs
    return graphs


@pytest.mark.parametrize("block_size", [16, 24])
def test_chunks_hits_and_decodes_as_grids(model_and_hf: tuple[Path, Any], block_size: int) -> None:
    path, hf = model_and_hf
    llm = LLM(str(path), max_num_batched_tokens=40, block_size=block_size)
    graphs = _with_grid(llm)
    prompt = prompt_ids(5, 130)
    first = llm.generate([prompt], GREEDY)  # chunks of 40 (Q = 64), then 5 decodes (Q = 1)
    again = llm.generate([prompt], GREEDY)  # prefix hit: the rest as one small grid, decodes
    hit = (129 // block_size) * block_size
    assert [first[0].num_cached_tokens, again[0].num_cached_tokens] == [0, hit]
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert graphs.steps == 4 + 5 + 1 + 5  # every step of both requests ran as a grid
    check_logits(hf, first + again)


def test_unequal_batch_pads_rows_and_queries(model_and_hf: tuple[Path, Any]) -> None:
    path, hf = model_and_hf
    llm = LLM(str(path), max_num_batched_tokens=256)
    graphs = _with_grid(llm)
    base = prompt_ids(6, 75)
    llm.generate([base], GREEDY)  # 75 tokens: Q = 128
    steps = graphs.steps
    # Three requests (R = 4, one padding row): a hit, a fresh one, a partial hit; then decodes.
    outs = llm.generate([base, prompt_ids(7, 9), [*base[:40], 1, 2, 3]], GREEDY)
    assert [o.num_cached_tokens for o in outs] == [64, 0, 32]
    assert graphs.steps - steps == 6
    check_logits(hf, outs)


def test_too_large_a_step_runs_eagerly(model_and_hf: tuple[Path, Any]) -> None:
    path, hf = model_and_hf
    llm = LLM(str(path), max_num_batched_tokens=256)
    graphs = _with_grid(llm, max_tokens=64)
    outs = llm.generate([prompt_ids(8, 100)], GREEDY)  # prefill Q = 128 > 64: eager; decodes: grid
    assert graphs.steps == 5
    check_logits(hf, outs)


def test_grid_shapes_round_up_to_powers_of_two(plain_model: Path) -> None:
    llm = LLM(str(plain_model), block_size=16)
    graphs = _with_grid(llm, max_tokens=64)
    rows = [GridRow([1] * 3, 100, [[1] * 7]), GridRow([1] * 5, 20, [[2] * 2])]
    # 2 rows, 5 tokens -> Q 8; keys up to position 104 -> 7 blocks -> at least 64 keys: 4 -> 8.
    assert graphs.shape_for(rows) == GridShape(2, 8, (8,))
    assert graphs.shape_for([GridRow([1], 4100, [[1] * 257])]) == GridShape(1, 1, (320,))  # 257 -> 5 x 64
    assert graphs.shape_for([GridRow([1] * 40, 0, [[1] * 3])] * 2) is None  # 2 x 64 > 64 tokens
    assert graphs.shape_for([]) is None


def test_bad_graph_settings_are_refused(plain_model: Path) -> None:
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="cuda_graph_max_tokens must be >= 1"):
        EngineConfig(model_dir=str(plain_model), cuda_graph_max_tokens=0).validate()
    llm = LLM(str(plain_model), enforce_eager=True)
    assert llm.engine.runner.graphs is None  # CPU: never graphs; enforce_eager is accepted
