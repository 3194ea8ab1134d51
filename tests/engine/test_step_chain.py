"""Async scheduling (engine.step_chain): decodes launched before the last step's tokens are read
give what synchronous steps give: the same tokens, texts, finish reasons and events.

On CPU the grid steps run eagerly (``capture=False``) and the chain is switched on by hand: the
bookkeeping (stops on the token just read, length, aborts, arrivals) is the same code as on
CUDA, where tests/engine/test_cuda.py checks it with captured graphs and device tokens.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from engine.event_sink import RecordingEventSink
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.step_graphs import StepGraphs
from tests.engine.hf_reference import prompt_ids

BASE = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _engine(path: Path, chained: bool) -> tuple[LLM, RecordingEventSink]:
    sink = RecordingEventSink()
    llm = LLM(str(path), event_sink=sink, max_num_batched_tokens=256, num_gpu_blocks=128)
    e = llm.engine
    e.runner.graphs = StepGraphs(e.model, e.kv_groups, e.runner.layer_slots, e.device, capture=False)
    e.chain.enabled = chained
    return llm, sink


def _stops(path: Path, prompts: list[list[int]]) -> list[SamplingParams]:
    """Per prompt: no stop, a stop token, a stop string (both taken from a synchronous run's
    output, so they are met mid-way), a short max_tokens."""
    ref = _engine(path, False)[0].generate(prompts, BASE)
    token = ref[1].outputs[0].token_ids[6]
    text = ref[2].outputs[0].text
    char = next(c for c in reversed(text) if c != "\ufffd")  # its last character: met late
    return [BASE, replace(BASE, stop_token_ids=(token,)), replace(BASE, stop=(char,)), replace(BASE, max_tokens=7)]


@pytest.mark.parametrize("which", ["plain_model", "hybrid_model"])
def test_chained_decodes_match_synchronous_steps(request: pytest.FixtureRequest, which: str) -> None:
    path: Path = request.getfixturevalue(which)
    prompts = [prompt_ids(i, n) for i, n in enumerate((20, 33, 47, 16))]
    params = _stops(path, prompts)
    runs = {}
    for chained in (False, True):
        llm, sink = _engine(path, chained)
        outs = llm.generate(prompts, params)
        runs[chained] = ([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs],
                         sink.events)
        assert (llm.engine.chain.launched > 10) is chained
        assert not llm.engine.has_unfinished and llm.engine.chain.pending is None
        assert llm.engine.kv.num_free_blocks == [128] * len(llm.engine.kv.pools)  # nothing leaked
    assert runs[True] == runs[False]
    reasons = [r for _, _, r in runs[True][0]]
    assert reasons == ["length", "stop", "stop", "length"]
    assert [len(t) for t, _, _ in runs[True][0]][0::3] == [20, 7]


def test_aborts_and_arrivals_between_chained_steps(plain_model: Path) -> None:
    """An abort while the request's next decode is on its way drops that decode; a request
    arriving meanwhile is admitted by the next synchronous step; the rest is unchanged."""
    runs = {}
    for chained in (False, True):
        llm, sink = _engine(plain_model, chained)
        core = llm.engine
        a = core.add_request(prompt_ids(1, 30), BASE)
        b = core.add_request(prompt_ids(2, 40), BASE)
        per_call = [[(o.request_id, o.new_token_ids[0]) for o in core.step()] for _ in range(5)]
        core.abort(a.request_id)
        c = core.add_request(prompt_ids(3, 25), replace(BASE, max_tokens=4))
        while core.has_unfinished:
            per_call.append([(o.request_id, o.new_token_ids[0]) for o in core.step()])
        core.abort(b.request_id)  # finished already: nothing happens
        runs[chained] = (per_call, [r.output_token_ids for r in (a, b, c)], [r.finish_reason for r in (a, b, c)],
                         sink.events)
        assert core.chain.pending is None
        assert core.kv.num_free_blocks == [128]
    assert runs[True][1:] == runs[False][1:]
    assert runs[True][2] == ["abort", "length", "length"]
    assert [len(t) for t in runs[True][1]] == [5, 20, 4]
    # Every call returns what the synchronous engine returned in the same call until the
    # arrival: the decode launched ahead is read first there, the admission comes a call later.
    sync, chained_calls = runs[False][0], runs[True][0]
    assert chained_calls[:5] == sync[:5]
    assert sorted(t for call in chained_calls for t in call) == sorted(t for call in sync for t in call)



@pytest.mark.parametrize("chained", [False, True])
def test_a_step_is_settled_only_when_every_step_before_was_read(plain_model: Path, chained: bool) -> None:
    """The engine tells the runner that a step is settled (no earlier step can still read its
    input buffer: StepGraphs skips the wait) only when every step launched before was read:
    not the one after a step that failed once launched."""
    from typing import Any

    llm, _ = _engine(plain_model, chained)
    e = llm.engine
    real = e.runner.execute
    seen: list[bool] = []
    fail = [False]

    def execute(*args: Any, settled: bool = False, **kwargs: Any) -> Any:
        seen.append(settled)
        logits = real(*args, settled=settled, **kwargs)
        if fail[0]:
            fail[0] = False
            raise RuntimeError("injected failure after the launch")
        return logits

    e.runner.execute = execute  # type: ignore[method-assign]
    llm.generate([prompt_ids(1, 40), prompt_ids(2, 20)], replace(BASE, max_tokens=4))
    assert all(seen) and (len(seen) == 1 if chained else len(seen) >= 4)  # chained: the decodes launched ahead
    seen.clear()
    e.add_request(prompt_ids(3, 30), replace(BASE, max_tokens=3))
    fail[0] = True
    with pytest.raises(RuntimeError, match="injected"):
        e.step()
    while e.has_unfinished:
        e.step()
    assert seen[:2] == [True, False]  # the failed step came after steps all read; its successor did not
    assert all(seen[2:])
