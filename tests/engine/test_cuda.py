"""CUDA path (bf16/fp16): the paged engine against a dense forward of the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.model.llama import DenseCausalAttention
from engine.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("which", ["plain_model", "hybrid_model"])
def test_cuda_engine_matches_dense_forward(request: pytest.FixtureRequest, which: str, dtype: str) -> None:
    path: Path = request.getfixturevalue(which)
    llm = LLM(str(path), device="cuda", dtype=dtype, max_num_batched_tokens=48)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (90, 20, 60)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, return_logits=True)
    outs = llm.generate(prompts, params) + llm.generate(prompts[:1], params)
    assert outs[-1].num_cached_tokens == 80
    model = llm.engine.model
    window = model.config.sliding_window
    for out in outs:
        gen = out.outputs[0]
        ids = out.prompt_token_ids + gen.token_ids
        if window is not None and len(ids) > window:
            continue  # the dense reference has no window; the hybrid model is checked on CPU
        with torch.inference_mode():
            t = torch.tensor(ids, device="cuda")
            hidden = model(t, torch.arange(len(ids), device="cuda"), DenseCausalAttention(1))
            ref = model.compute_logits(hidden).float().cpu()
        p = len(out.prompt_token_ids)
        torch.testing.assert_close(torch.stack(gen.logits), ref[p - 1 : p - 1 + 8], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("which", ["plain_model", "hybrid_model"])
def test_cuda_graph_replay_matches_eager_steps(request: pytest.FixtureRequest, which: str) -> None:
    """Small steps replay captured graphs (engine.step_graphs); they must give what the eager
    runner gives: same greedy tokens, logits within bf16 noise, also after many replays."""
    path: Path = request.getfixturevalue(which)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (90, 20, 60, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, return_logits=True)
    runs = {}
    for eager in (True, False):
        llm = LLM(str(path), device="cuda", dtype="float32", max_num_batched_tokens=48, enforce_eager=eager)
        outs = llm.generate(prompts, params) + llm.generate(prompts[:2], params)
        graphs = llm.engine.runner.graphs
        if eager:
            assert graphs is None
        else:
            assert graphs is not None and graphs.captures > 0 and graphs.steps > 2 * graphs.captures
        runs[eager] = outs
    for a, b in zip(runs[True], runs[False], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.num_cached_tokens == b.num_cached_tokens
        torch.testing.assert_close(torch.stack(b.outputs[0].logits), torch.stack(a.outputs[0].logits),
                                   atol=1e-3, rtol=1e-3)
