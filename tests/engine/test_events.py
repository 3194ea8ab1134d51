"""Exact KV event sequences for scripted scenarios (vLLM semantics, 64-bit wire hashes)."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from engine.event_sink import RecordingEventSink
from engine.llm import LLM
from engine.sampling import SamplingParams
from events.hashing import BlockHasher, to_wire
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, LogRecord
from events.state import CacheState

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
HASHER = BlockHasher(EngineConfig(model_dir="m").hash_seed, 16)  # the engine's default seed


def _tokens(start: int, n: int) -> list[int]:
    return [(start + i) % 256 for i in range(n)]


def _wire(tokens: list[int]) -> tuple[int, ...]:
    return tuple(to_wire(d) for d in HASHER.hash_blocks(tokens))


def _stored(tokens: list[int], first: int, last: int, group: int = 0, window: int | None = None) -> BlockStored:
    hashes = _wire(tokens)
    return BlockStored(
        block_hashes=hashes[first:last],
        parent_block_hash=hashes[first - 1] if first else None,
        token_ids=tuple(tokens[first * 16 : last * 16]),
        block_size=16,
        medium="GPU",
        group_idx=group,
        kv_cache_spec_kind="full_attention" if window is None else "sliding_window",
        sliding_window=window,
    )


def _removed(tokens: list[int], i: int, group: int = 0) -> BlockRemoved:
    return BlockRemoved(block_hashes=(_wire(tokens)[i],), medium="GPU", group_idx=group)


def _engine(path: Path, **kw: int) -> tuple[LLM, RecordingEventSink]:
    sink = RecordingEventSink()
    return LLM(str(path), event_sink=sink, **kw), sink  # type: ignore[arg-type]


def _reduce(sink: RecordingEventSink) -> CacheState:
    state = CacheState()
    for i, batch in enumerate(sink.batches, start=1):
        state.apply(LogRecord(offset=i, source="e", incarnation=1, source_seq=i, ts=0.0, events=tuple(batch)))
    return state


def _pool_view(llm: LLM) -> dict[tuple[str, str, int], frozenset[int]]:
    return {
        ("e", "GPU", p.group_idx): frozenset(to_wire(d) for d in p.hash_to_block)
        for p in llm.engine.kv.pools
        if p.hash_to_block
    }


def test_new_prefix_stores_its_full_blocks(plain_model: Path) -> None:
    llm, sink = _engine(plain_model)
    a = _tokens(0, 40)
    llm.generate([a], ONE)
    assert sink.take() == [_stored(a, 0, 2)]


def test_engine_hashes_equal_kvctl_hashes(plain_model: Path) -> None:
    llm, sink = _engine(plain_model)
    llm.generate([_tokens(5, 33)], ONE)
    (event,) = sink.take()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == tuple(to_wire(d) for d in BlockHasher(HASHER.seed, 16, "sha256_cbor").hash_blocks(_tokens(5, 33)))


def test_shared_prefix_stores_only_new_blocks(plain_model: Path) -> None:
    llm, sink = _engine(plain_model)
    a = _tokens(0, 40)
    b = a[:32] + _tokens(100, 20)
    llm.generate([a], ONE)
    outs = llm.generate([b], ONE)
    assert outs[0].num_cached_tokens == 32
    assert sink.take() == [_stored(a, 0, 2), _stored(b, 2, 3)]


def test_decode_tokens_complete_blocks_too(plain_model: Path) -> None:
    llm, sink = _engine(plain_model)
    a = _tokens(0, 30)
    out = llm.generate([a], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    full = a + out[0].outputs[0].token_ids
    # 34 computed tokens (the last sampled one is never computed): two full blocks.
    assert sink.take() == [_stored(full, 0, 1), _stored(full, 1, 2)]


def test_eviction_follows_lru_and_reports_removed_hashes(plain_model: Path) -> None:
    llm, sink = _engine(plain_model, num_gpu_blocks=4)
    a, b = _tokens(0, 40), _tokens(50, 40)
    llm.generate([a], ONE)
    llm.generate([b], ONE)
    llm.generate([a], ONE)
    assert sink.take() == [
        _stored(a, 0, 2),
        _removed(a, 1),  # a's tail block is the least recently used cached block
        _stored(b, 0, 2),
        _removed(b, 1),  # a's first block was hit; b's tail goes for a's second block
        _stored(a, 1, 2),
    ]


def test_reset_prefix_cache_clears_all_and_forgets_hits(plain_model: Path) -> None:
    llm, sink = _engine(plain_model)
    a = _tokens(0, 40)
    llm.generate([a], ONE)
    assert llm.reset_prefix_cache() is True
    outs = llm.generate([a], ONE)
    assert outs[0].num_cached_tokens == 0
    assert sink.take() == [_stored(a, 0, 2), AllBlocksCleared(medium="GPU"), _stored(a, 0, 2)]


def test_reset_is_refused_while_blocks_are_in_use(plain_model: Path) -> None:
    llm, sink = _engine(plain_model)
    llm.engine.add_request(_tokens(0, 40), SamplingParams(temperature=0.0, max_tokens=5))
    llm.engine.step()
    assert llm.reset_prefix_cache() is False
    assert all(not isinstance(e, AllBlocksCleared) for e in sink.take())


def test_same_prefix_in_one_step_is_stored_once(plain_model: Path) -> None:
    llm, sink = _engine(plain_model)
    a = _tokens(0, 40)
    llm.generate([a, a], ONE)
    assert sink.take() == [_stored(a, 0, 2)]
    assert llm.engine.kv.pools[0].num_free_blocks == 256


def test_hybrid_model_stores_both_groups(hybrid_model: Path) -> None:
    llm, sink = _engine(hybrid_model)
    a = _tokens(0, 40)
    llm.generate([a], ONE)
    assert sink.take() == [_stored(a, 0, 2), _stored(a, 0, 2, group=1, window=32)]


def test_hybrid_sliding_blocks_are_freed_but_stay_cached(hybrid_model: Path) -> None:
    llm, sink = _engine(hybrid_model, max_num_batched_tokens=32)
    a = _tokens(0, 100)
    llm.engine.add_request(a, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    steps = [llm.engine.step() for _ in range(4)]
    assert [len(s) for s in steps] == [0, 0, 0, 1]
    assert sink.take() == [
        _stored(a, 0, 2), _stored(a, 0, 2, 1, 32),
        _stored(a, 2, 4), _stored(a, 2, 4, 1, 32),
        _stored(a, 4, 6), _stored(a, 4, 6, 1, 32),
    ]
    # Everything is freed now, but every hash is still cached (no BlockRemoved) and a rerun
    # hits 96 tokens: the full group needs all 6 blocks, the sliding group only the last 2.
    outs = llm.generate([a], ONE)
    assert outs[0].num_cached_tokens == 96
    assert sink.take() == []


def test_hybrid_sliding_window_frees_blocks_during_a_request(hybrid_model: Path) -> None:
    llm, _ = _engine(hybrid_model, max_num_batched_tokens=32, num_gpu_blocks=16)
    llm.engine.add_request(_tokens(0, 100), ONE)
    for _ in range(3):
        llm.engine.step()
    table = llm.engine.kv.block_table("req-0")
    # The third step was scheduled at 64 computed tokens: the query at 64 sees keys 33..64, so
    # the sliding group released blocks 0-1 before allocating 4-5; the full group keeps all 6.
    assert table[1][:2] == [0, 0] and 0 not in table[1][2:] and 0 not in table[0]
    assert [len(t) for t in table] == [6, 6]
    assert [p.num_free_blocks for p in llm.engine.kv.pools] == [16 - 6, 16 - 4]


def test_reducer_over_events_equals_block_pool(hybrid_model: Path) -> None:
    llm, sink = _engine(hybrid_model, num_gpu_blocks=12, max_num_batched_tokens=48)
    prompts = [_tokens(s, n) for s, n in [(0, 70), (30, 50), (0, 90), (200, 64), (0, 33)]]
    for i in range(0, len(prompts), 2):
        llm.generate(prompts[i : i + 2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    state = _reduce(sink)
    assert state.view() == _pool_view(llm)
    assert state.violations == []
    assert any(isinstance(e, BlockRemoved) for e in sink.events)
