"""The engine core calls the connector's steps in the order engine.kv_connector writes down,
also when a step fails (a recording connector: the null one, with its calls written down)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from engine.kv_connector import LayerWaits, NewBlocks, NullConnector
from engine.llm import LLM
from engine.sampling import SamplingParams

BS = 16
GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


class _FailingWaits:
    def wait_layer(self, group_idx: int, layer: int) -> None:
        raise RuntimeError("the step failed")


class RecordingConnector(NullConnector):
    """No second tier; records the connector calls of each step (``fail``: the next step's
    layer waits raise, as a device error in the middle of a step would)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.stored: list[int] = []
        self.fail = False

    def take_layer_waits(self) -> LayerWaits | None:
        self.calls.append("take_layer_waits")
        if self.fail:
            self.fail = False
            return _FailingWaits()
        return None

    def finish_loads(self) -> None:
        self.calls.append("finish_loads")

    def store(self, new_blocks: Sequence[NewBlocks]) -> None:
        self.calls.append("store")
        self.stored.append(sum(len(nb.block_ids) for nb in new_blocks))

    def check_loads(self) -> set[str]:
        self.calls.append("check_loads")
        return set()

    def step_done(self) -> None:
        self.calls.append("step_done")


STEP = ["take_layer_waits", "finish_loads", "store", "check_loads", "step_done"]


def test_each_step_calls_the_connector_in_order(plain_model: Path) -> None:
    conn = RecordingConnector()
    llm = LLM(str(plain_model), connector=conn, num_gpu_blocks=64)
    llm.generate([list(range(2 * BS + 1))], GREEDY)  # a prefill step and a decode step
    assert conn.calls == STEP * 2
    assert conn.stored == [2, 0]  # the prompt's 2 full blocks, then none


def test_a_failed_step_still_finishes_and_checks_its_loads(plain_model: Path) -> None:
    conn = RecordingConnector()
    llm = LLM(str(plain_model), connector=conn, num_gpu_blocks=64)
    llm.engine.add_request(list(range(BS + 1)), GREEDY)
    conn.fail = True
    with pytest.raises(RuntimeError, match="the step failed"):
        llm.engine.step()
    assert conn.calls == ["take_layer_waits", "finish_loads", "check_loads", "step_done"]
    assert conn.stored == []  # store() is skipped: the step made no blocks
