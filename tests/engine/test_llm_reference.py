"""End-to-end logits of the paged engine equal transformers' on the same checkpoint.

Every generated token's logits row is compared with a full forward of transformers over
prompt + generated tokens, so prefill chunks, decode steps, prefix-cache hits, the sliding
window and preemption are all checked against the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.llm import LLM
from engine.request import RequestOutput
from engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, return_logits=True)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def _check(hf: Any, outputs: list[RequestOutput]) -> None:
    for out in outputs:
        gen = out.outputs[0]
        assert gen.logits is not None and len(gen.logits) == len(gen.token_ids) == 12
        ids = out.prompt_token_ids + gen.token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        p = len(out.prompt_token_ids)
        torch.testing.assert_close(torch.stack(gen.logits), ref[p - 1 : p - 1 + 12], atol=1e-4, rtol=1e-4)
        assert gen.token_ids == ref[p - 1 : p - 1 + 12].argmax(-1).tolist()


@pytest.fixture(scope="module", params=["plain", "hybrid"])
def model(request: pytest.FixtureRequest) -> tuple[Path, Any]:
    path: Path = request.getfixturevalue(f"{request.param}_model")
    return path, AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_single_request(model: tuple[Path, Any]) -> None:
    path, hf = model
    outs = LLM(str(path)).generate(_prompts(0, [70]), GREEDY)
    assert outs[0].num_cached_tokens == 0
    _check(hf, outs)


def test_batched_with_chunked_prefill(model: tuple[Path, Any]) -> None:
    path, hf = model
    llm = LLM(str(path), max_num_batched_tokens=24, enable_prefix_caching=False)
    _check(hf, llm.generate(_prompts(1, [70, 5, 33, 100]), GREEDY))


def test_prefix_cache_hits_keep_logits_exact(model: tuple[Path, Any]) -> None:
    path, hf = model
    llm = LLM(str(path), max_num_batched_tokens=64)
    base = _prompts(2, [90])[0]
    first = llm.generate([base], GREEDY)
    # Same prompt (hit capped below the prompt length), a branch, and a short shared prefix.
    second = llm.generate([base, [*base[:50], 7, 8, 9], base[:20]], GREEDY)
    assert [o.num_cached_tokens for o in first + second] == [0, 80, 48, 16]
    _check(hf, first + second)


def test_preemption_under_a_small_pool(model: tuple[Path, Any]) -> None:
    path, hf = model
    llm = LLM(str(path), num_gpu_blocks=10, max_num_batched_tokens=64)
    _check(hf, llm.generate(_prompts(3, [60, 50, 40]), GREEDY))
    assert llm.engine.scheduler.num_preemptions > 0
