"""A request's state inside the engine, and the outputs handed back to callers."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from engine.digest_memo import DigestMemo
from engine.sampling import SamplingParams
from events.hashing import BlockHasher

if TYPE_CHECKING:
    from engine.output_text import OutputText


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class PreparedPrompt:
    """A checked prompt: its text (None when given as token ids), its ids, and the same ids
    as a read-only int64 array (None only where some id cannot be one)."""

    text: str | None
    token_ids: list[int]
    ids: np.ndarray | None


@dataclass
class Request:
    """Tokens, progress and sampling state of one sequence."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None
    """Sampling's random stream; None: made from ``seed`` when first needed (a greedy request never
    needs one: creating and seeding it at every arrival was host work before the first token)."""
    prompt: str | None = None
    prompt_array: np.ndarray | None = None
    """``prompt_token_ids`` as an int64 array, hashed without a conversion (None: hash the list)."""
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    """Tokens served from the GPU prefix cache at first admission (-1 until admitted)."""
    num_external_cached_tokens: int = 0
    """Tokens loaded from the offload tier at first admission."""
    num_hashed_blocks: int = 0
    """Leading full blocks already registered in the block pool (or skipped as duplicates)."""
    finish_reason: str | None = None
    output_text: str = ""
    num_text_streamed: int = 0
    """Characters of output_text already streamed (the rest may still change or be cut)."""
    logits: list[Tensor] = field(default_factory=list)
    text: OutputText | None = field(default=None, repr=False)
    """The output text as it is built (engine.output_text), made at the first token."""
    _digests: list[bytes] = field(default_factory=list)
    seed: int = 0
    """Seeds ``generator`` when it is made."""

    def sampler(self) -> torch.Generator:
        """``generator``, made from ``seed`` on first use."""
        if self.generator is None:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.seed)
        return self.generator

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def next_token_ends_by_length(self, max_model_len: int) -> bool:
        """Whether the token being computed ends this request by length, whatever it is (as
        engine.output_text.next_output will find once it is appended)."""
        return len(self.output_token_ids) + 1 >= self.max_tokens or self.num_tokens + 1 >= max_model_len

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without copying the whole sequence first."""
        prompt = self.prompt_token_ids
        n = len(prompt)
        if end <= n:
            return prompt[start:end]
        if start >= n:  # a decode: its tokens are outputs (no copy of a long prompt each step)
            return self.output_token_ids[start - n : end - n]
        return prompt[start:] + self.output_token_ids[: end - n]

    def block_digests(self, hasher: BlockHasher | DigestMemo, num_blocks: int) -> list[bytes]:
        """Full digests of the first ``num_blocks`` full blocks, computed once and chained."""
        have = len(self._digests)
        if have < num_blocks:
            bs = hasher.block_size
            parent = self._digests[-1] if have else None
            start, end = have * bs, num_blocks * bs
            ids = self.prompt_array
            tokens = ids[start:end] if ids is not None and end <= len(ids) else self.token_ids(start, end)
            # One call for all new blocks: the hasher's fast path works on a whole prompt.
            self._digests.extend(hasher.hash_blocks(tokens, parent))
        return self._digests[:num_blocks]


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logits: list[Tensor] | None = None


@dataclass(frozen=True)
class RequestOutput:
    """What ``LLM.generate`` returns per prompt (the shape of vLLM's)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    num_external_cached_tokens: int = 0


@dataclass(frozen=True)
class StepOutput:
    """New tokens of one request in one step (what the streaming server sends)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_external_cached_tokens: int
