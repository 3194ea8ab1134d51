"""Hypothesis strategies for random (valid-but-wrong) protobuf messages of every RPC.

Each strategy mixes wild values with near-valid ones (registered engine ids, well-formed 32-byte
digests, digests already stored, live reservation and lease ids, consistent event batches), so
the fuzzer gets past the first checks into the handlers' state changes too.
"""

from __future__ import annotations

from hypothesis import strategies as st
from kvcache.v1 import events_pb2, generate_pb2, log_pb2, offload_pb2

U32 = st.integers(0, 2**32 - 1)
U64 = st.one_of(st.integers(0, 16), st.integers(0, 2**64 - 1))
I64 = st.integers(-(2**63), 2**63 - 1)
SMALL_U64 = st.one_of(st.integers(0, 8), st.just(2**64 - 1))
TEXT = st.one_of(st.sampled_from(["", "e", "fuzz-engine", "offloadd"]), st.text(max_size=40))
DIGEST = st.binary(min_size=32, max_size=32)
KNOWN = [bytes([i]) * 32 for i in range(1, 9)]  # stored by the test before fuzzing
HASH = st.one_of(DIGEST, st.sampled_from(KNOWN), st.binary(max_size=80))
ENGINE = st.one_of(st.sampled_from(["fz-a", "fz-b"]), st.sampled_from(["", "offloadd", "unknown", "x" * 300]))


def group_layout() -> st.SearchStrategy[offload_pb2.GroupLayout]:
    near_valid = st.builds(
        offload_pb2.GroupLayout, group_idx=st.integers(0, 2), kind=st.integers(1, 2),
        sliding_window=st.sampled_from([0, 32]), block_size=st.sampled_from([4, 16]),
        block_bytes=st.sampled_from([256, 1024, 4096]), dtype=st.sampled_from(["uint8", "float32"]),
        layout=st.sampled_from(["synthetic-layout", "other"]),
    )
    return near_valid | st.builds(
        offload_pb2.GroupLayout,
        group_idx=st.one_of(st.integers(0, 3), U32), kind=st.integers(0, 5),
        sliding_window=st.one_of(st.just(0), U32), block_size=st.one_of(st.integers(0, 32), U32),
        block_bytes=st.one_of(st.integers(0, 4096), U64), dtype=TEXT, layout=TEXT,
    )


def register() -> st.SearchStrategy[offload_pb2.RegisterEngineRequest]:
    return st.builds(offload_pb2.RegisterEngineRequest, engine_id=ENGINE, incarnation=U64,
                     model_namespace=TEXT, groups=st.lists(group_layout(), max_size=4))


def lookup() -> st.SearchStrategy[offload_pb2.LookupRequest]:
    query = st.builds(offload_pb2.GroupQuery, group_idx=st.one_of(st.integers(0, 3), U32),
                      block_hashes=st.lists(HASH, max_size=12), prefix_only=st.booleans())
    return st.builds(offload_pb2.LookupRequest, engine_id=ENGINE, queries=st.lists(query, max_size=4),
                     pin=st.booleans(), lease_ms=st.one_of(st.integers(0, 5000), U32))


def reserve() -> st.SearchStrategy[offload_pb2.ReserveRequest]:
    block = st.builds(offload_pb2.BlockToStore, block_hash=HASH, parent_block_hash=HASH,
                      token_ids=st.lists(U32, max_size=40), extra_keys=st.binary(max_size=40))
    return st.builds(offload_pb2.ReserveRequest, engine_id=ENGINE, group_idx=st.one_of(st.integers(0, 3), U32),
                     blocks=st.lists(block, max_size=8), lease_ms=st.one_of(st.integers(0, 5000), U32),
                     lora_name=TEXT)


def commit(ids: list[str]) -> st.SearchStrategy[offload_pb2.CommitRequest]:
    """``ids``: live reservation ids (each can be committed once; later tries must fail cleanly)."""
    return st.builds(offload_pb2.CommitRequest, engine_id=ENGINE, reservation_id=st.sampled_from(ids) | TEXT,
                     block_hashes=st.lists(HASH, max_size=6))


def abort(ids: list[str]) -> st.SearchStrategy[offload_pb2.AbortRequest]:
    return st.builds(offload_pb2.AbortRequest, engine_id=ENGINE, reservation_id=st.sampled_from(ids) | TEXT)


def release(ids: list[str]) -> st.SearchStrategy[offload_pb2.ReleaseRequest]:
    return st.builds(offload_pb2.ReleaseRequest, engine_id=ENGINE, lease_id=st.sampled_from(ids) | TEXT)


def read_blocks() -> st.SearchStrategy[offload_pb2.ReadBlocksRequest]:
    return st.builds(offload_pb2.ReadBlocksRequest, engine_id=ENGINE, group_idx=st.one_of(st.integers(0, 3), U32),
                     block_hashes=st.lists(HASH, max_size=6))


def kv_event() -> st.SearchStrategy[events_pb2.KvEvent]:
    wire = st.one_of(st.integers(0, 20), st.integers(0, 2**64 - 1))
    stored = st.builds(
        events_pb2.BlockStored, block_hashes=st.lists(wire, max_size=6),
        parent_block_hash=st.one_of(st.none(), wire), token_ids=st.lists(U32, max_size=30),
        block_size=st.one_of(st.integers(0, 8), U32), medium=st.integers(0, 4),
        group_idx=st.one_of(st.integers(0, 2), U32), kv_cache_spec_kind=st.integers(0, 4),
        sliding_window=st.one_of(st.none(), U32), lora_name=st.one_of(st.none(), TEXT),
        extra_keys=st.lists(st.binary(max_size=12), max_size=3),
    )
    removed = st.builds(events_pb2.BlockRemoved, block_hashes=st.lists(wire, max_size=6),
                        medium=st.integers(0, 4), group_idx=st.one_of(st.integers(0, 2), U32))
    cleared = st.builds(events_pb2.AllBlocksCleared, medium=st.integers(0, 4))
    return st.one_of(
        st.builds(events_pb2.KvEvent),
        st.builds(events_pb2.KvEvent, block_stored=stored),
        st.builds(events_pb2.KvEvent, block_removed=removed),
        st.builds(events_pb2.KvEvent, all_blocks_cleared=cleared),
    )


@st.composite
def _consistent_stored(draw: st.DrawFn) -> events_pb2.KvEvent:
    n = draw(st.integers(1, 4))
    bs = draw(st.sampled_from([4, 16]))
    return events_pb2.KvEvent(block_stored=events_pb2.BlockStored(
        block_hashes=draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n)),
        parent_block_hash=draw(st.none() | st.integers(0, 2**64 - 1)),
        token_ids=draw(st.lists(st.integers(0, 50_000), min_size=n * bs, max_size=n * bs)),
        block_size=bs, medium=1, group_idx=draw(st.integers(0, 1)),
    ))


def event_batch() -> st.SearchStrategy[events_pb2.EventBatch]:
    ts = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 2e9))
    near_valid = st.builds(
        events_pb2.EventBatch, engine_id=st.sampled_from(["fz-a", "fz-b", "fz-c"]),
        incarnation=st.integers(1, 3), seq=st.integers(1, 8), ts=st.floats(0, 2e9),
        events=st.lists(_consistent_stored() | kv_event(), min_size=1, max_size=3),
    )
    return near_valid | st.builds(events_pb2.EventBatch, engine_id=ENGINE, incarnation=SMALL_U64,
                     seq=st.one_of(st.integers(0, 6), U64), ts=ts, events=st.lists(kv_event(), max_size=4))


def subscribe() -> st.SearchStrategy[log_pb2.SubscribeRequest]:
    return st.builds(log_pb2.SubscribeRequest, from_offset=U64, follow=st.just(False))


def generate() -> st.SearchStrategy[generate_pb2.GenerateRequest]:
    sampling = st.builds(
        generate_pb2.SamplingParams, max_tokens=st.one_of(st.integers(0, 4), U32),
        temperature=st.one_of(st.floats(-2, 3, width=32), st.floats(width=32)),
        top_p=st.one_of(st.floats(-1, 2, width=32), st.floats(width=32)),
        seed=st.one_of(st.none(), U64), stop=st.lists(st.text(max_size=5), max_size=3),
        stop_token_ids=st.lists(U32, max_size=3), ignore_eos=st.booleans(),
    )
    ids = st.builds(generate_pb2.TokenIds, ids=st.lists(st.one_of(st.integers(0, 600), U32), max_size=40))
    return st.one_of(
        st.builds(generate_pb2.GenerateRequest, request_id=TEXT, token_ids=ids, sampling=sampling),
        st.builds(generate_pb2.GenerateRequest, request_id=TEXT, text=st.text(max_size=40), sampling=sampling),
        st.builds(generate_pb2.GenerateRequest, request_id=TEXT, sampling=sampling),
    )
