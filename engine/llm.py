"""``LLM(model_dir, ...).generate(prompts, SamplingParams)``: the offline API, shaped like vLLM's."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, cast

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.event_sink import EventSink
from engine.kv_connector import OffloadConnector
from engine.model.tokenizer import Tokenizer
from engine.request import CompletionOutput, Request, RequestOutput
from engine.sampling import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Runs requests to completion with continuous batching. Keyword arguments are EngineConfig
    fields (device, dtype, block_size, num_gpu_blocks, ...)."""

    def __init__(
        self,
        model_dir: str,
        *,
        event_sink: EventSink | None = None,
        connector: OffloadConnector | None = None,
        **config: Any,
    ) -> None:
        self.engine = EngineCore(EngineConfig(model_dir=model_dir, **config), event_sink, connector)

    @classmethod
    def from_config(
        cls, config: EngineConfig, event_sink: EventSink | None = None, connector: OffloadConnector | None = None
    ) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = EngineCore(config, event_sink, connector)
        return llm

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in input order.

        Every request is validated before any is queued, so a bad one refuses the whole call."""
        batch, plain_ints = _as_batch(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        per = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        if len(per) != len(batch):
            raise ValueError(f"got {len(per)} sampling params for {len(batch)} prompts")
        for p in per:
            p.validate()
        prepared = [self.engine.prepare_prompt(prompt, plain_ints=plain_ints) for prompt in batch]
        reqs = [self.engine.add_prepared(prompt, pa) for prompt, pa in zip(prepared, per, strict=True)]
        while self.engine.has_unfinished:
            self.engine.step()
        return [_output(r) for r in reqs]

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> tuple[list[Prompt], bool]:
    """The prompts, and whether they are one prompt of token ids already made plain ints."""
    if isinstance(prompts, str):
        return [prompts], False
    items = list(prompts)
    # In C: every item's type, counted as it is made (4,096 ids: ~20 us on the CPU VM; a list
    # of the types and its count ~30, a set of them ~50).
    if items and operator.countOf(map(type, items), int) == len(items):  # one prompt given as token ids
        return [cast("list[int]", items)], True
    if items and all(issubclass(t, int) for t in set(map(type, items))):  # ... some of them bools or IntEnums
        return [[int(t) for t in cast("list[int]", items)]], True
    return cast("list[Prompt]", items), False


def _output(req: Request) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        # The request's own list (it copied the caller's; nothing changes it once finished).
        prompt_token_ids=req.prompt_token_ids,
        outputs=[
            CompletionOutput(
                index=0, text=req.output_text, token_ids=list(req.output_token_ids),
                finish_reason=req.finish_reason,
                logits=list(req.logits) if req.params.return_logits else None,
            )
        ],
        finished=req.is_finished,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        num_external_cached_tokens=req.num_external_cached_tokens,
    )
