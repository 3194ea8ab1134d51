"""The order of a step's host work: what may happen while the GPU still computes the token.

A request that this step's token ends by length releases its blocks before the token is read
(engine_core ``_free_ending``), but only as a leading run of the step's requests, so that the
LRU free queue (and every later eviction and event) is what it was when each request freed its
blocks as its token came. A greedy request never makes a random generator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.engine_core import EngineCore
from engine.llm import LLM
from engine.request import Request
from engine.sampling import SamplingParams


def _engine(model: Path, early: bool = True) -> EngineCore:
    engine = LLM(str(model), max_model_len=256, num_gpu_blocks=64).engine
    if not early:
        engine._free_ending = lambda launched: None  # type: ignore[method-assign]
    return engine


def _tables_at_read(engine: EngineCore) -> list[set[str]]:
    """The request ids holding block tables each time a step's tokens are read."""
    seen: list[set[str]] = []
    outputs = engine._outputs

    def spy(launched: Any) -> Any:
        seen.append(set(engine.kv.block_tables))
        return outputs(launched)

    engine._outputs = spy  # type: ignore[method-assign]
    return seen


def test_a_request_ending_by_length_frees_its_blocks_before_its_token_is_read(plain_model: Path) -> None:
    engine = _engine(plain_model)
    seen = _tables_at_read(engine)
    req = engine.add_request(list(range(1, 41)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    # Step 1 (the prompt): the request goes on, its blocks stay; step 2: its last token.
    assert seen == [{req.request_id}, set()]
    assert req.finish_reason == "length" and len(req.output_token_ids) == 2
    assert engine.kv.num_free_blocks == [64]


def _run(model: Path, early: bool, order: list[str]) -> tuple[list[list[int]], list[set[str]], dict[str, str | None]]:
    """Three requests admitted in one step, in ``order``: "eos" ends on its first token by EOS,
    "one" and "one_b" by length. Returns the free queue, the tables at each read, the reasons."""
    engine = _engine(model, early)
    seen = _tables_at_read(engine)
    reqs: dict[str, Request] = {}
    for n, name in enumerate(order):
        prompt = [(7 * n + i) % 200 + 1 for i in range(20 + 5 * n)]
        reqs[name] = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=5 if name == "eos" else 1),
                                        request_id=name)
    reqs["eos"].eos_token_ids = tuple(range(512))  # whatever it samples ends it
    while engine.has_unfinished:
        engine.step()
    return ([list(p.free_queue) for p in engine.kv.pools], seen,
            {name: r.finish_reason for name, r in reqs.items()})


@pytest.mark.parametrize("order", [["one", "one_b", "eos"], ["eos", "one", "one_b"], ["one", "eos", "one_b"]])
def test_early_frees_keep_the_free_queue_order(plain_model: Path, order: list[str]) -> None:
    queue, seen, reasons = _run(plain_model, True, order)
    ref_queue, ref_seen, ref_reasons = _run(plain_model, False, order)
    assert reasons == ref_reasons == {"eos": "eos", "one": "length", "one_b": "length"}
    assert queue == ref_queue
    # Only the requests ending by length that no possibly-continuing request precedes went early.
    lead = []
    for name in order:
        if name == "eos":
            break
        lead.append(name)
    assert seen == [set(order) - set(lead)]
    assert ref_seen == [set(order)]


def test_only_a_sampling_request_makes_a_generator(plain_model: Path) -> None:
    engine = _engine(plain_model)
    greedy = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2))
    sampled = engine.add_request([4, 5, 6], SamplingParams(temperature=1.0, max_tokens=2, seed=3))
    while engine.has_unfinished:
        engine.step()
    assert greedy.generator is None
    assert sampled.generator is not None and sampled.seed == 3
