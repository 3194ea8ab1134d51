"""Checks of engine outputs against transformers' logits, shared by the runner-path tests."""

from __future__ import annotations

from typing import Any

import torch

from engine.request import RequestOutput
from engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, return_logits=True)


def prompt_ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_logits(hf: Any, outputs: list[RequestOutput]) -> None:
    """Every generated token's logits equal the reference model's on prompt + output (1e-4)."""
    for out in outputs:
        gen = out.outputs[0]
        assert gen.logits is not None and len(gen.logits) == len(gen.token_ids) == 6
        with torch.no_grad():
            ref = hf(torch.tensor([out.prompt_token_ids + gen.token_ids])).logits[0]
        p = len(out.prompt_token_ids)
        torch.testing.assert_close(torch.stack(gen.logits), ref[p - 1 : p - 1 + 6], atol=1e-4, rtol=1e-4)
