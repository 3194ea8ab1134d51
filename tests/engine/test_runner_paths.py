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

from engine.llm import LLM
from tests.engine.hf_reference import GREEDY, check_logits, prompt_ids


@pytest.mark.parametrize("block_size", [16, 24])
def test_one_request_alone_through_chunks_hits_and_decodes(model_and_hf: tuple[Path, Any], block_size: int) -> None:
    path, hf = model_and_hf
    llm = LLM(str(path), max_num_batched_tokens=40, block_size=block_size)
    prompt = prompt_ids(5, 130)
    first = llm.generate([prompt], GREEDY)  # chunks of 40 after the first: lower-right, q = 40
    again = llm.generate([prompt], GREEDY)  # prefix hit, then the rest alone
    hit = (129 // block_size) * block_size
    assert [first[0].num_cached_tokens, again[0].num_cached_tokens] == [0, hit]
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    check_logits(hf, first + again)


def test_batch_next_to_a_hit_takes_the_masked_grid(model_and_hf: tuple[Path, Any]) -> None:
    path, hf = model_and_hf
    llm = LLM(str(path), max_num_batched_tokens=256)
    base = prompt_ids(6, 75)
    llm.generate([base], GREEDY)
    outs = llm.generate([base, prompt_ids(7, 9), [*base[:40], 1, 2, 3]], GREEDY)
    assert [o.num_cached_tokens for o in outs] == [64, 0, 32]
    check_logits(hf, outs)
