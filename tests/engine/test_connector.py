"""The offload connector against a real offloadd (subprocess, real Redis) and real tiny models."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from engine.event_sink import RecordingEventSink
from engine.llm import LLM
from engine.offload.config import OffloadConnectorConfig
from engine.offload.connector import OffloadingConnector
from engine.sampling import SamplingParams
from engine.step_graphs import StepGraphs
from events.hashing import to_wire
from offloadd.client import OffloadClient
from tests.support.offloadd_proc import DaemonProcess

BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, return_logits=True)


@pytest.fixture
def daemon(tmp_path: Path, redis_url: str) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_path / "d", redis_url, "c" + uuid.uuid4().hex[:8],
                         capacity_bytes=32 << 20, chunk_bytes=1 << 20)
    proc.start()
    yield proc
    proc.kill()


@pytest.fixture(params=["plain", "hybrid"])
def model(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_model")


def _connector(daemon: DaemonProcess, engine_id: str = "e1", **kw: object) -> OffloadingConnector:
    return OffloadingConnector(
        OffloadConnectorConfig(target=daemon.target, engine_id=engine_id, model_namespace="tiny", **kw)  # type: ignore[arg-type]
    )


def _llm(model: Path, connector: OffloadingConnector | None = None) -> LLM:
    return LLM(str(model), connector=connector, num_gpu_blocks=64, max_num_batched_tokens=256)


def _loaded_bytes(llm: LLM, num_blocks: int) -> int:
    total = 0
    for g in llm.engine.kv_groups:
        window = g.spec.sliding_window
        first = 0 if window is None else max(0, num_blocks * BS - window + 1) // BS
        total += (num_blocks - first) * g.block_bytes
    return total


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


@pytest.mark.parametrize("path", ["layerwise", "layerwise-grid", "whole", "ask-first"])
def test_store_then_cpu_hit_equals_reference(model: Path, daemon: DaemonProcess, path: str) -> None:
    """``layerwise``: each layer is copied as the step reaches it (engine.offload.layerwise);
    ``-grid``: the step runs as a padded grid (engine.step_graphs, eager here) that waits per
    layer; ``whole``: the copy completes before the step. Each starts the copy from the slots
    the engine remembers from its own store, before the pin's answer (engine.offload.view);
    ``ask-first`` waits for the answer."""
    conn = _connector(daemon, layerwise=path != "whole", speculate=path != "ask-first")
    llm, ref = _llm(model, conn), _llm(model)
    if path.endswith("-grid"):
        e = llm.engine
        e.runner.graphs = StepGraphs(e.model, e.kv_groups, e.runner.layer_slots, e.device, capture=False)
    prompt = _prompt(5 * BS + 7, 1)  # 5 full blocks + 7 tokens
    first = llm.generate(prompt, GREEDY)[0]
    assert conn.flush()
    groups = len(llm.engine.kv_groups)
    # Prompt + 6 new tokens = 93 tokens: the 5 full prompt blocks are stored, in every group.
    with OffloadClient(daemon.target) as c:
        assert c.stats().num_blocks == 5 * groups
    assert llm.reset_prefix_cache()
    again = llm.generate(prompt, GREEDY)[0]
    expected = ref.generate(prompt, GREEDY)[0]
    assert first.outputs[0].token_ids == expected.outputs[0].token_ids
    assert again.num_cached_tokens == 0
    assert again.num_external_cached_tokens == 5 * BS
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids
    got, want = again.outputs[0].logits, expected.outputs[0].logits
    assert got is not None and want is not None
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1.3e-6, atol=1e-5)
    assert conn.flush()
    s = conn.stats()
    block_bytes = sum(g.block_bytes for g in llm.engine.kv_groups)
    assert s["blocks_stored"] == 5 * groups and s["bytes_stored"] == 5 * block_bytes
    # Sliding-window groups load only the blocks that cover the window at the end of the hit,
    # and the engine leaves the others null: not allocated, not hashed.
    assert s["blocks_loaded"] == 5 and s["bytes_loaded"] == _loaded_bytes(llm, 5)
    digests = llm.engine.hasher.hash_blocks(prompt)
    for pool in llm.engine.kv.pools:
        window = pool.sliding_window
        first_needed = 0 if window is None else max(0, 5 * BS - window + 1) // BS
        assert set(pool.hash_to_block) == set(digests[first_needed:5])
    assert s["cpu_hit_tokens"] == 5 * BS and s["errors"] == 0
    assert (s["speculative_loads"], s["speculation_failed"]) == ((0, 0) if path == "ask-first" else (1, 0))
    assert s["load_copy_seconds"] > 0
    assert s["blocks_already_stored"] == 0  # loaded blocks are not stored back
    if path != "whole":
        assert conn.loads.loader is not None and conn.loads.loader.issued == {"kernel": groups}  # one load per group, on CPU
    with OffloadClient(daemon.target) as c:  # the load's lease was released
        assert sum(x.num_pinned for x in c.stats().layouts) == 0
    conn.close()


def _same_outputs(got: list, want: list) -> None:  # type: ignore[type-arg]
    for x, y in zip(got, want, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        xl, yl = x.outputs[0].logits, y.outputs[0].logits
        assert xl is not None and yl is not None
        for p, q in zip(xl, yl, strict=True):
            torch.testing.assert_close(p, q, rtol=1.3e-6, atol=1e-5)


def test_a_stale_view_of_the_host_tier_is_not_used(model: Path, daemon: DaemonProcess) -> None:
    """A daemon restart gives every block a new generation (published again once its bytes
    are verified), so the engine's view no longer matches the generation table: the next hit
    asks first instead of loading from the view. The answer refreshes the view and the hit
    after that loads from it again. Outputs equal a run without offloading."""
    conn = _connector(daemon)
    llm, ref = _llm(model, conn), _llm(model)
    a = _prompt(4 * BS + 3, 21)
    want = ref.generate([a], GREEDY)
    llm.generate(a, GREEDY)
    assert conn.flush() and llm.reset_prefix_cache()
    digests = llm.engine.hasher.hash_blocks(a)
    before = {g.spec.group_idx: conn.tier.view.find(g.spec.group_idx, digests) for g in llm.engine.kv_groups}
    daemon.kill()
    daemon.restart()
    got = llm.generate([a], GREEDY)
    _same_outputs(got, want)
    assert got[0].num_external_cached_tokens == 4 * BS
    assert conn.flush()
    s = conn.stats()
    assert (s["speculative_loads"], s["speculation_failed"], s["errors"]) == (0, 0, 0)
    for gi, (slots, gens) in before.items():  # same slots, new generations, learned
        now_slots, now_gens = conn.tier.view.find(gi, digests)
        known = [i for i, x in enumerate(slots) if x >= 0]
        assert known and all(now_slots[i] == slots[i] and now_gens[i] > gens[i] for i in known)
    assert llm.reset_prefix_cache()
    _same_outputs(llm.generate([a], GREEDY), want)
    assert conn.flush()
    assert (conn.stats()["speculative_loads"], conn.stats()["speculation_failed"]) == (1, 0)
    with OffloadClient(daemon.target) as client:  # the asking load's lease was released
        assert sum(x.num_pinned for x in client.stats().layouts) == 0
    conn.close()


def test_a_slot_given_away_during_the_load_redoes_the_step(model: Path, daemon: DaemonProcess) -> None:
    """The daemon restarts while A's load from the view runs (every slot gets a new
    generation: the table no longer vouches for what was read), and A's step also computes
    A's next block. The step's stores and GPU-cache registrations run before the check; once
    it fails, that block is neither sent to the host tier nor left in the GPU prefix cache,
    and A is admitted again, asking first. Both tiers then hold what the redone step computed,
    and the outputs equal a run without offloading."""
    conn = _connector(daemon)
    sink = RecordingEventSink()
    llm = LLM(str(model), event_sink=sink, connector=conn, num_gpu_blocks=64, max_num_batched_tokens=256)
    ref = _llm(model)
    a, b = _prompt(4 * BS, 41), _prompt(2 * BS + 5, 42)
    llm.generate([a[: 3 * BS + 1]], GREEDY)  # A's first 3 blocks in the host tier
    assert conn.flush() and llm.reset_prefix_cache()
    digests_a = llm.engine.hasher.hash_blocks(a)
    load, restarted = conn.load, []

    def load_then_restart(*args: object, **kwargs: object) -> None:
        load(*args, **kwargs)  # type: ignore[arg-type]
        if not restarted:  # on CPU the copies run inside the step, after this
            restarted.append(True)
            daemon.kill()
            daemon.restart()

    conn.load = load_then_restart  # type: ignore[method-assign]
    sink.take()
    got = llm.generate([a, b], GREEDY)  # B, in the same step, goes on
    _same_outputs(got, ref.generate([a, b], GREEDY))
    assert got[0].num_external_cached_tokens == 3 * BS  # loaded again, after asking
    assert conn.flush()
    s = conn.stats()
    assert (s["speculative_loads"], s["speculation_failed"]) == (0, 1)
    assert s["cpu_hit_tokens"] == 3 * BS  # counted once: the dropped load hit nothing
    assert s["blocks_already_stored"] == 0  # the dropped step's store of block 3 was not sent
    # GPU events of A's block 3: stored by the dropped step and removed in the same step,
    # then stored by the redone one (once per group).
    wire = to_wire(digests_a[3])
    kinds = [type(e).__name__ for e in sink.take()
             if wire in getattr(e, "block_hashes", ()) and getattr(e, "medium", "GPU") == "GPU"]
    groups = len(llm.engine.kv_groups)
    assert kinds == ["BlockStored"] * groups + ["BlockRemoved"] * groups + ["BlockStored"] * groups
    with OffloadClient(daemon.target) as client:
        for g, pool in zip(llm.engine.kv_groups, llm.engine.kv.pools, strict=True):
            gi = g.spec.group_idx
            block = pool.get_cached_block(digests_a[3])
            assert block is not None
            (held,) = client.read_blocks("e1", gi, [digests_a[3]])
            mine = conn.tier.arenas[gi].gather(g.tensor, [block])
            assert held.data == mine.numpy().tobytes()
        assert sum(x.num_pinned for x in client.stats().layouts) == 0
    conn.close()


def test_offloaded_block_spans_engine_blocks(model: Path, daemon: DaemonProcess) -> None:
    conn = _connector(daemon, block_size_multiple=2)
    llm, ref = _llm(model, conn), _llm(model)
    groups = len(llm.engine.kv_groups)
    prompt = _prompt(5 * BS + 10, 9)
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert conn.flush()
    # 97 computed tokens = 6 full engine blocks; engine block 5 filled up during decode and
    # completed the third offloaded block (engine blocks 4 and 5) one step later than block 4.
    with OffloadClient(daemon.target) as c:
        assert c.stats().num_blocks == 3 * groups
    s = conn.stats()
    assert s["blocks_stored"] == 3 * groups
    assert s["bytes_stored"] == 6 * sum(g.block_bytes for g in llm.engine.kv_groups)
    seq = (prompt + out.outputs[0].token_ids)[: 6 * BS + 1]
    assert llm.reset_prefix_cache()
    got = llm.generate(seq, GREEDY)[0]
    assert (got.num_cached_tokens, got.num_external_cached_tokens) == (0, 6 * BS)
    want = ref.generate(seq, GREEDY)[0].outputs[0].token_ids
    assert got.outputs[0].token_ids == want
    # A GPU hit that ends inside an offloaded block: the load starts in the middle of it.
    assert conn.flush() and llm.reset_prefix_cache()
    llm.generate(seq[: 3 * BS + 1], GREEDY)
    got = llm.generate(seq, GREEDY)[0]
    assert (got.num_cached_tokens, got.num_external_cached_tokens) == (3 * BS, 3 * BS)
    assert got.outputs[0].token_ids == want
    assert conn.flush()
    # Every hit (three) loaded from the engine's view (offloaded-block keys, its own commits).
    assert (conn.stats()["speculative_loads"], conn.stats()["speculation_failed"]) == (3, 0)
    conn.close()


def test_gpu_hit_then_cpu_tier_extends_it(plain_model: Path, daemon: DaemonProcess) -> None:
    conn = _connector(daemon)
    llm, ref = _llm(plain_model, conn), _llm(plain_model)
    long_prompt = _prompt(6 * BS + 3, 2)
    llm.generate(long_prompt, GREEDY)
    assert conn.flush() and llm.reset_prefix_cache()
    llm.generate(long_prompt[: 2 * BS + 1], GREEDY)  # GPU now holds the first 2 blocks
    out = llm.generate(long_prompt, GREEDY)[0]
    assert (out.num_cached_tokens, out.num_external_cached_tokens) == (2 * BS, 4 * BS)
    assert out.outputs[0].token_ids == ref.generate(long_prompt, GREEDY)[0].outputs[0].token_ids
    assert conn.stats()["gpu_hit_tokens"] == 2 * BS
    conn.close()


def test_two_engines_share_one_daemon(model: Path, daemon: DaemonProcess) -> None:
    a, b = _connector(daemon, "engine-a"), _connector(daemon, "engine-b")
    llm_a, llm_b = _llm(model, a), _llm(model, b)
    prompt = _prompt(4 * BS + 1, 3)
    want = llm_a.generate(prompt, GREEDY)[0].outputs[0].token_ids
    assert a.flush()
    out = llm_b.generate(prompt, GREEDY)[0]
    assert out.num_external_cached_tokens == 4 * BS
    assert out.outputs[0].token_ids == want
    assert b.flush() and b.stats()["speculative_loads"] == 0  # B's view knew nothing: it asked
    # B learned where the blocks sit from that answer: its next hit loads before asking.
    assert llm_b.reset_prefix_cache()
    again = llm_b.generate(prompt, GREEDY)[0]
    assert again.num_external_cached_tokens == 4 * BS and again.outputs[0].token_ids == want
    assert b.flush() and (b.stats()["speculative_loads"], b.stats()["speculation_failed"]) == (1, 0)
    a.close()
    b.close()


def test_daemon_gone_a_hit_the_table_vouches_for_still_loads(plain_model: Path, daemon: DaemonProcess) -> None:
    """The daemon is killed after the store. The view holds the prefix, the arena and the
    generation table are still mapped, and only the daemon gives slots away: the hit loads
    from the view with no RPC, and the output equals a run without offloading. Only the
    report of the hit to the daemon fails (logged and counted)."""
    conn = _connector(daemon, retry_register_s=60.0, timeout_s=1.0)
    llm, ref = _llm(plain_model, conn), _llm(plain_model)
    prompt = _prompt(4 * BS + 3, 31)
    llm.generate(prompt, GREEDY)
    assert conn.flush() and llm.reset_prefix_cache()
    daemon.kill()
    out = llm.generate(prompt, GREEDY)[0]
    want = ref.generate(prompt, GREEDY)[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert out.num_external_cached_tokens == 4 * BS
    assert conn.flush()
    s = conn.stats()
    assert (s["speculative_loads"], s["speculation_failed"]) == (1, 0)
    assert s["cpu_hit_tokens"] == 4 * BS and s["errors"] >= 1
    conn.close()


def test_without_a_generation_table_every_hit_asks_first(plain_model: Path, daemon: DaemonProcess) -> None:
    """A daemon that publishes no generation table (older, or its file is gone): the engine
    never loads from its view; every hit asks first, pinned, and is still a hit."""
    conn = _connector(daemon)
    llm, ref = _llm(plain_model, conn), _llm(plain_model)
    for path in daemon.arena_dir.glob("*-Cgen"):
        path.unlink()
    conn.tier.register()  # maps what the daemon offers now
    prompt = _prompt(4 * BS + 3, 33)
    want = ref.generate(prompt, GREEDY)[0].outputs[0].token_ids
    llm.generate(prompt, GREEDY)
    for _ in range(2):
        assert conn.flush() and llm.reset_prefix_cache()
        out = llm.generate(prompt, GREEDY)[0]
        assert out.outputs[0].token_ids == want and out.num_external_cached_tokens == 4 * BS
    assert conn.flush()
    s = conn.stats()
    assert (s["speculative_loads"], s["speculation_failed"], s["errors"]) == (0, 0, 0)
    assert s["lookups"] == 3  # the first, cold, request asked too
    conn.close()


def test_daemon_failure_never_breaks_generation(plain_model: Path, daemon: DaemonProcess) -> None:
    conn = _connector(daemon, retry_register_s=60.0, timeout_s=1.0)
    llm, ref = _llm(plain_model, conn), _llm(plain_model)
    daemon.kill()
    prompt = _prompt(3 * BS + 2, 4)
    out = llm.generate(prompt, GREEDY)[0]
    assert conn.flush()
    assert out.outputs[0].token_ids == ref.generate(prompt, GREEDY)[0].outputs[0].token_ids
    assert out.num_external_cached_tokens == 0
    assert conn.stats()["errors"] >= 1
    conn.close()


def test_unreachable_at_start_registers_later(plain_model: Path, daemon: DaemonProcess) -> None:
    """An engine that found no daemon runs without the host tier, and registers once one is
    there. gRPC's channel reconnects with its own backoff (1 s, 1.6 s, ...), so the daemon being
    SERVING does not mean this engine's channel is connected yet: wait until registering works,
    then the request's blocks are stored."""
    daemon.stop()
    conn = _connector(daemon, retry_register_s=0.0, timeout_s=1.0)
    llm = _llm(plain_model, conn)
    assert conn.stats()["errors"] == 1 and not conn.tier.is_active()
    daemon.restart()
    deadline = time.monotonic() + 60
    while not conn.tier.is_active():  # registers again on each call (retry_register_s=0)
        assert time.monotonic() < deadline, "never registered with the restarted daemon"
        time.sleep(0.1)
    prompt = _prompt(2 * BS + 1, 5)
    llm.generate(prompt, GREEDY)
    assert conn.flush()
    assert conn.stats()["blocks_stored"] == 2
    conn.close()


def test_disabled_connector_is_inert(plain_model: Path, daemon: DaemonProcess) -> None:
    conn = _connector(daemon, enabled=False)
    llm = _llm(plain_model, conn)
    llm.generate(_prompt(3 * BS, 6), GREEDY)
    with OffloadClient(daemon.target) as c:
        st = c.stats()
        assert (st.num_engines, st.num_blocks) == (0, 0)
    assert conn.stats()["blocks_stored"] == 0
    conn.close()


def test_store_dropped_when_too_much_is_pending(plain_model: Path, daemon: DaemonProcess) -> None:
    conn = _connector(daemon, max_pending_store_bytes=1)
    llm = _llm(plain_model, conn)
    llm.generate(_prompt(2 * BS + 1, 7), GREEDY)
    assert conn.flush()
    s = conn.stats()
    assert (s["stores_dropped"], s["blocks_stored"]) == (1, 0)
    conn.close()


def test_prometheus_export(plain_model: Path, daemon: DaemonProcess) -> None:
    registry = CollectorRegistry()
    conn = OffloadingConnector(
        OffloadConnectorConfig(target=daemon.target, engine_id="e1", model_namespace="tiny"),
        registry=registry,
    )
    llm = _llm(plain_model, conn)
    llm.generate(_prompt(2 * BS + 1, 8), GREEDY)
    assert conn.flush()
    text = generate_latest(registry).decode()
    assert 'kv_engine_offload_blocks_stored_total{engine_id="e1"} 2.0' in text
    assert 'kv_engine_offload_pending_store_bytes{engine_id="e1"} 0.0' in text
    conn.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target": ""}, "target"),
        ({"engine_id": ""}, "engine_id"),
        ({"model_namespace": ""}, "model_namespace"),
        ({"block_size_multiple": 0}, "block_size_multiple must be >= 1"),
        ({"lease_ms": -1}, "lease_ms"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"max_pending_store_bytes": 0}, "max_pending_store_bytes"),
        ({"copy_mode": "dma"}, "copy_mode"),
        ({"layer_copies": "units"}, "layer_copies must be halving or per-layer, got 'units'"),
    ],
)
def test_config_refuses_bad_values(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"target": "127.0.0.1:1", "engine_id": "e", "model_namespace": "m"}
    with pytest.raises(ValueError, match=message):
        OffloadConnectorConfig(**{**base, **kwargs})  # type: ignore[arg-type]


def test_load_lease_is_released_after_the_step(plain_model: Path, daemon: DaemonProcess) -> None:
    """The worker thread is not woken during admission (it would share the GIL with the step
    being launched) nor before the step's outputs are made: a load's lease goes back with the
    step's finish_loads() and step_done() calls."""
    conn = _connector(daemon, speculate=False)  # a load from the view pins nothing
    llm = _llm(plain_model, conn)
    prompt = _prompt(4 * BS + 3, 9)
    llm.generate(prompt, GREEDY)
    assert conn.flush() and llm.reset_prefix_cache()
    digests = llm.engine.hasher.hash_blocks(prompt)
    assert conn.lookup("r1", digests, 0) == 4
    conn.load("r1", digests, {0: [1, 2, 3, 4]})

    def pinned() -> int:
        with OffloadClient(daemon.target) as c:
            return sum(x.num_pinned for x in c.stats().layouts)

    conn.finish_loads()  # the step is over: its loads complete in stream order
    conn.store([])
    assert conn.check_loads() == set()
    assert pinned() == 4  # the release is prepared, not yet handed over
    assert conn.worker is not None and conn.worker.wait_idle(5)
    assert pinned() == 4
    conn.step_done()  # the step's outputs are made
    assert conn.flush()
    assert pinned() == 0
    assert conn.stats()["blocks_loaded"] == 4
    conn.close()


def test_the_step_finishes_its_loads_only_when_told(plain_model: Path, daemon: DaemonProcess) -> None:
    """The connector's steps are explicit calls, in order (engine.kv_connector): store()
    touches no load, even with no blocks; a load from the view, layer by layer on CPU, is
    copied by finish_loads() (the step waited for no layer here) and checked by the
    check_loads() that follows it, which reports the hit to the daemon after step_done()."""
    conn = _connector(daemon)  # layer by layer, loads from the view
    llm = _llm(plain_model, conn)
    prompt = _prompt(4 * BS + 3, 10)
    llm.generate(prompt, GREEDY)
    assert conn.flush() and llm.reset_prefix_cache()
    kv = llm.engine.kv_groups[0].tensor
    want = kv[1:5].clone()  # blocks 1-4 held the prompt's blocks (ascending ids)
    kv[1:5] = 0
    digests = llm.engine.hasher.hash_blocks(prompt)
    assert conn.lookup("r1", digests, 0) == 4
    conn.load("r1", digests[:4], {0: [1, 2, 3, 4]})
    assert conn.take_layer_waits() is not None  # in flight: the step would wait per layer
    lookups = conn.stats()["lookups"]

    conn.store([])
    assert conn.check_loads() == set()  # before finish_loads(): nothing to check yet
    assert conn.take_layer_waits() is not None and not kv[1:5].any()
    assert conn.stats()["speculative_loads"] == 0

    conn.finish_loads()
    assert conn.take_layer_waits() is None
    assert torch.equal(kv[1:5], want)
    conn.finish_loads()  # a second call finds nothing left
    conn.store([])
    assert conn.check_loads() == set()
    assert conn.stats()["speculative_loads"] == 1
    assert conn.flush()
    assert conn.stats()["lookups"] == lookups + 1  # the hit, reported once the step is done
    conn.request_finished("r1")
    conn.close()
