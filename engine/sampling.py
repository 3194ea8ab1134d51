"""Sampling parameters (shaped like vLLM's) and the sampler: greedy, temperature, top-p, seeded."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.errors import InvalidRequest

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (as in vLLM): dividing logits by a denormal-small
temperature overflows to inf and the softmax turns into NaN."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature < SAMPLING_EPS`` (0 included) is greedy."""

    max_tokens: int | None = 16
    """New tokens at most; None: the engine's default_max_tokens."""
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_logits: bool = False
    """Debug/testing: keep the float32 logits row each generated token was sampled from."""

    def validate(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequest(f"seed must be in [0, 2**63), got {self.seed}")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def sample_token(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token from a float32 CPU logits row of one request (``generator``: None only
    when greedy)."""
    if params.is_greedy:
        return int(torch.argmax(logits).item())
    assert generator is not None, "sampling needs a generator"
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        drop = (cum - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())
