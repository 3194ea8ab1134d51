"""The router's choice on a real CacheState (built by the reducer from records, as the follower
builds it from the bridge): prefix runs across an engine's GPU tier and its node's host tier,
the KV-aware score against load, the plain policies, prediction outcomes, and config errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from events.hashing import BlockHasher, to_wire
from events.schema import BlockRemoved, BlockStored, LogRecord
from events.state import CacheState
from router.config import EngineSpec, RouterConfig, RouterConfigError, engines_from_file
from router.fleet import EngineState
from router.policy import Chooser, prefix_run
from router.truth import Truth, classify

BS = 4
HASHER = BlockHasher("0", BS)
TOKENS = list(range(40))  # 10 blocks
HASHES = [to_wire(d) for d in HASHER.hash_blocks(TOKENS)]


def _stored(first: int, last: int, medium: str) -> BlockStored:
    return BlockStored(tuple(HASHES[first:last]), HASHES[first - 1] if first else None,
                       tuple(TOKENS[first * BS : last * BS]), BS, medium)  # type: ignore[arg-type]


class Fleet:
    """Two engines on one node: e0 caches blocks 0-5 on GPU, the node blocks 0-8 in CPU."""

    def __init__(self) -> None:
        self.state = CacheState()
        self.offset = 0
        self.apply("e0", _stored(0, 6, "GPU"))
        self.apply("offloadd", _stored(0, 9, "CPU"))
        self.e0 = EngineState(EngineSpec("e0", "http://127.0.0.1:1"), healthy=True)
        self.e1 = EngineState(EngineSpec("e1", "http://127.0.0.1:2"), healthy=True)

    def apply(self, source: str, event: object) -> None:
        self.offset += 1
        self.state.apply(LogRecord(self.offset, source, 0, 0, 0.0, (event,)))  # type: ignore[arg-type]


def _config(policy: str = "kv", **kw: object) -> RouterConfig:
    return RouterConfig(engines=(EngineSpec("e0", "http://127.0.0.1:1"), EngineSpec("e1", "http://127.0.0.1:2")),
                        policy=policy, block_size=BS, **kw)  # type: ignore[arg-type]


def test_prefix_run_continues_from_gpu_into_the_node_host_tier() -> None:
    f = Fleet()
    assert prefix_run(f.state, HASHES, f.e0) == (6, 3)
    assert prefix_run(f.state, HASHES, f.e1) == (0, 9)
    f.apply("offloadd", BlockRemoved((HASHES[6],), "CPU"))
    assert prefix_run(f.state, HASHES, f.e0) == (6, 0)  # the host tier's run must start at block 6
    assert prefix_run(f.state, HASHES, f.e1) == (0, 6)
    assert prefix_run(f.state, HASHES[:0], f.e0) == (0, 0)


def test_kv_policy_prefers_gpu_then_trades_prefix_for_load() -> None:
    f = Fleet()
    chooser = Chooser(_config())
    d = chooser.choose([f.e0, f.e1], HASHES, f.state)
    assert (d.engine.name, d.reason, d.gpu_blocks, d.cpu_blocks) == ("e0", "gpu_prefix", 6, 3)
    # Scores in tokens: e0 4*(6 + 0.8*3) = 33.6, e1 4*(0.8*9) = 28.8; one request in flight
    # costs 64, so e1 wins once e0 has one.
    f.e0.in_flight = 1
    d = chooser.choose([f.e0, f.e1], HASHES, f.state)
    assert (d.engine.name, d.reason, d.cpu_blocks) == ("e1", "cpu_prefix", 9)
    f.e1.in_flight = 3
    d = chooser.choose([f.e0, f.e1], HASHES, f.state)
    assert (d.engine.name, d.reason) == ("e0", "gpu_prefix")
    d = chooser.choose([f.e1], HASHES, f.state)  # e0 tried already: only e1 left
    assert (d.engine.name, d.reason) == ("e1", "cpu_prefix")


def test_kv_policy_names_load_when_a_longer_prefix_lost() -> None:
    f = Fleet()
    f.apply("offloadd", BlockRemoved(tuple(HASHES), "CPU"))
    f.e0.in_flight = 5
    d = Chooser(_config()).choose([f.e0, f.e1], HASHES, f.state)
    assert (d.engine.name, d.reason, d.gpu_blocks) == ("e1", "load", 0)


def test_kv_policy_without_any_prefix_or_view_goes_least_loaded() -> None:
    f = Fleet()
    other = [to_wire(d) for d in HASHER.hash_blocks([7] * 16)]
    f.e0.in_flight = 1
    chooser = Chooser(_config())
    d = chooser.choose([f.e0, f.e1], other, f.state)
    assert (d.engine.name, d.reason) == ("e1", "no_prefix")
    d = chooser.choose([f.e0, f.e1], HASHES, None)
    assert (d.engine.name, d.reason, d.gpu_blocks) == ("e1", "no_cache_view", 0)


def test_plain_policies() -> None:
    f = Fleet()
    rr = Chooser(_config("round-robin"))
    picks = [rr.choose([f.e0, f.e1], HASHES, f.state) for _ in range(4)]
    assert [p.engine.name for p in picks] == ["e0", "e1", "e0", "e1"]
    assert {p.reason for p in picks} == {"round_robin"}
    assert (picks[0].gpu_blocks, picks[1].cpu_blocks) == (6, 9)  # predicted for truth all the same
    f.e0.in_flight = 2
    ll = Chooser(_config("least-loaded"))
    assert {ll.choose([f.e0, f.e1], HASHES, f.state).engine.name for _ in range(3)} == {"e1"}
    a = [Chooser(_config("random", seed=3)).choose([f.e0, f.e1], HASHES, f.state).engine.name for _ in range(1)]
    b = [Chooser(_config("random", seed=3)).choose([f.e0, f.e1], HASHES, f.state).engine.name for _ in range(1)]
    assert a == b


def test_prediction_outcomes() -> None:
    assert classify(64, 64, 64) == "agree"
    assert classify(0, 64, 64) == "event_lag"
    assert classify(0, 64, 0) == "hash_mismatch"
    assert classify(64, 32, 64) == "eviction_race"
    truth = Truth()
    entry = truth.decided("r1", "e0", "gpu_prefix", 64)
    assert truth.reported(entry, 64, 64) == "agree"
    entry2 = truth.decided("r2", "e1", "no_prefix", 0)
    assert truth.reported(entry2, 32, 0) == "hash_mismatch"
    assert truth.agreement == 0.5 and entry2["cached_tokens"] == 32
    assert truth.decisions_by_reason[("gpu_prefix", "e0")] == 1


def test_config_errors(tmp_path: Path) -> None:
    spec = EngineSpec.parse("e0=http://h:1/,source=engine-0,node=offloadd-b")
    assert (spec.name, spec.url, spec.source, spec.node_source) == ("e0", "http://h:1", "engine-0", "offloadd-b")
    assert EngineSpec.parse("http://h:2").source == "http://h:2"
    for bad in ("e0=ftp://h", "e0=http://h:1,color=red", "=http://h:1", "e0=http://h:99999", "e0=http://h:x"):
        with pytest.raises(RouterConfigError):
            EngineSpec.parse(bad)
    with pytest.raises(RouterConfigError, match="at least one engine"):
        RouterConfig(engines=())
    with pytest.raises(RouterConfigError, match="unique"):
        RouterConfig(engines=(spec, spec))
    with pytest.raises(RouterConfigError, match="both"):
        RouterConfig(engines=(spec,), bridge_pub="tcp://h:1")
    for weight in (-1.0, math.nan, math.inf):  # a nan weight made every score nan, routing at random
        with pytest.raises(RouterConfigError, match=f"^load_weight must be a finite number >= 0, got {weight}$"):
            RouterConfig(engines=(spec,), load_weight=weight)
    path = tmp_path / "engines.toml"
    path.write_text('[[engines]]\nname = "a"\nurl = "http://h:3"\nnode = "n1"\n')
    assert engines_from_file(str(path))[0].node_source == "n1"
    path.write_text('[[engines]]\nname = "a"\n')
    with pytest.raises(RouterConfigError, match="url"):
        engines_from_file(str(path))
    path.write_text("not toml [")
    with pytest.raises(RouterConfigError, match="cannot read"):
        engines_from_file(str(path))
