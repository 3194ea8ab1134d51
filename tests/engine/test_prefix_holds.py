"""Prefix holds (engine.prefix_holds): a queued request's cached prefix survives the other
requests' allocations until its admission; holds never make anyone wait or be preempted."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.request import Request
from engine.sampling import SamplingParams

BS = 16
P = list(range(1, 4 * BS + 1))  # the prefix: 4 full blocks
Q = list(range(200, 200 + 4 * BS))


def _core(model: Path, hold: bool, blocks: int = 16, budget: int = 64) -> EngineCore:
    return EngineCore(EngineConfig(model_dir=str(model), block_size=BS, num_gpu_blocks=blocks,
                                   max_num_batched_tokens=budget, max_model_len=512,
                                   hold_prefix_on_arrival=hold))


def _run(core: EngineCore, prompt: list[int], rid: str) -> Request:
    req = core.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), rid)
    while core.has_unfinished:
        core.step()
    return req


def _race(core: EngineCore) -> Request:
    """P then Q computed and freed (Q more recently); then B, a long fresh prompt prefilled in
    chunks, and C = P + a question, queued behind it. B needs more than the never-cached
    blocks, so without a hold the LRU front evicts P's blocks while C waits."""
    _run(core, [*P, 7], "a")
    _run(core, [*Q, 7], "d")
    core.add_request([300 + i % 200 for i in range(10 * BS)], SamplingParams(max_tokens=1, temperature=0), "b")
    c = core.add_request([*P, 9, 9, 9], SamplingParams(max_tokens=1, temperature=0), "c")
    while core.has_unfinished:
        core.step()
    return c


def test_a_held_prefix_survives_the_wait(plain_model: Path) -> None:
    c = _race(_core(plain_model, hold=True))
    assert c.num_cached_tokens == len(P)


def test_without_holds_the_prefix_is_evicted_while_it_waits(plain_model: Path) -> None:
    """The same race without holds: what a router predicted from the events is gone."""
    c = _race(_core(plain_model, hold=False))
    assert c.num_cached_tokens < len(P)


@pytest.mark.parametrize("model", ["plain_model", "hybrid_model"])
def test_holds_give_way_and_leave_nothing_behind(model: str, request: pytest.FixtureRequest) -> None:
    """A pool too small for B and the held prefix together: the hold is dropped, B runs without
    a preemption, C still finishes; afterwards every block is free again."""
    core = _core(request.getfixturevalue(model), hold=True, blocks=12)
    _run(core, [*P, 7], "a")
    b = core.add_request([300 + i % 200 for i in range(10 * BS)], SamplingParams(max_tokens=1, temperature=0), "b")
    c = core.add_request([*P, 9, 9, 9], SamplingParams(max_tokens=1, temperature=0), "c")
    assert core.scheduler.holds.num_requests == 1
    while core.has_unfinished:
        core.step()
    assert b.finish_reason == c.finish_reason == "length"
    assert core.scheduler.num_preemptions == 0
    assert core.scheduler.holds.num_requests == 0
    assert all(p.num_free_blocks == p.num_blocks for p in core.kv.pools)


def test_an_aborted_waiting_request_drops_its_hold(plain_model: Path) -> None:
    core = _core(plain_model, hold=True)
    _run(core, [*P, 7], "a")
    core.add_request([*P, 1, 2], SamplingParams(max_tokens=1), "c")
    assert core.scheduler.holds.num_blocks == 4
    assert core.kv.pools[0].num_free_blocks == 16 - 4
    core.abort("c")
    assert core.scheduler.holds.num_blocks == 0
    assert core.kv.pools[0].num_free_blocks == 16
    assert _run(core, [*P, 3], "e").num_cached_tokens == len(P)  # still cached after the release


def test_an_admission_reuses_the_holds_match_only_while_nothing_cached_changed(plain_model: Path) -> None:
    """A hold matched at the KV manager's current version is the admission's hit (no second
    match); once a cached block came or went, the admission matches again."""
    core = _core(plain_model, hold=True)
    _run(core, [*P, 7], "a")
    holds, kv = core.scheduler.holds, core.kv
    req = core.add_request([*P, 9, 9], SamplingParams(max_tokens=1, temperature=0), "c")
    assert holds.fresh_hit("c") == len(P) // BS
    matches = []
    find = kv.find_prefix_hit
    kv.find_prefix_hit = lambda r: matches.append(r.request_id) or find(r)  # type: ignore[method-assign]
    while core.has_unfinished:
        core.step()
    assert matches == [] and req.num_cached_tokens == len(P)
    # Blocks cached meanwhile: d's first chunk (the whole step's budget) is registered while e
    # waits behind it, so e's admission matches again (its hold matched once, at arrival).
    core.add_request([*Q, 7], SamplingParams(max_tokens=1, temperature=0), "d")
    e = core.add_request([*P, 5, 5], SamplingParams(max_tokens=1, temperature=0), "e")
    assert holds.fresh_hit("e") == len(P) // BS
    core.step()
    assert holds.fresh_hit("e") is None and e.num_computed_tokens == 0
    while core.has_unfinished:
        core.step()
    assert matches == ["d", "e", "d", "e"] and e.num_cached_tokens == len(P)
    assert kv.num_free_blocks == [16]
