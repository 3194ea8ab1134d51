"""Each attention path of the model runner against transformers' logits.

The runner picks per step and group: dense causal (fresh request), lower-right causal over the
request's own keys (one request with earlier context, no window) or the padded, masked grid
(batches, windows). These tests drive one request alone through the lower-right path with
several query lengths (chunked prefill, prefix hit, decode), with block sizes whose key grid
is and is not a multiple of 64, and a batch next to it through the masked path.
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

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, return_logits=True)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(hf: Any, outputs: list[RequestOutput]) -> None:
    for out in outputs:
        gen = out.outputs[0]
        assert gen.logits is not None and len(gen.logits) == len(gen.token_ids) == 6
        with torch.no_grad():
            ref = hf(torch.tensor([out.prompt_token_ids + gen.token_ids])).logits[0]
        p = len(out.prompt_token_ids)
        torch.testing.assert_close(torch.stack(gen.logits), ref[p - 1 : p - 1 + 6], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=["plain", "hybrid"])
def model(request: pytest.FixtureRequest) -> tuple[Path, Any]:
    path: Path = request.getfixturevalue(f"{request.param}_model")
    return path, AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("block_size", [16, 24])
def test_one_request_alone_through_chunks_hits_and_decodes(model: tuple[Path, Any], block_size: int) -> None:
    path, hf = model
    llm = LLM(str(path), max_num_batched_tokens=40, block_size=block_size)
    prompt = _prompt(5, 130)
    first = llm.generate([prompt], GREEDY)  # chunks of 40 after the first: lower-right, q = 40
    again = llm.generate([prompt], GREEDY)  # prefix hit, then the rest alone
    hit = (129 // block_size) * block_size
    assert [first[0].num_cached_tokens, again[0].num_cached_tokens] == [0, hit]
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    _check(hf, first + again)


def test_batch_next_to_a_hit_takes_the_masked_grid(model: tuple[Path, Any]) -> None:
    path, hf = model
    llm = LLM(str(path), max_num_batched_tokens=256)
    base = _prompt(6, 75)
    llm.generate([base], GREEDY)
    outs = llm.generate([base, _prompt(7, 9), [*base[:40], 1, 2, 3]], GREEDY)
    assert [o.num_cached_tokens for o in outs] == [64, 0, 32]
    _check(hf, outs)
