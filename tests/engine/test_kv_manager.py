"""KVCacheManager: forgetting a step's blocks whose KV turned out wrong."""

from __future__ import annotations

import torch

from engine.kv_cache import KVCacheGroupSpec
from engine.kv_manager import KVCacheManager
from engine.request import Request
from engine.sampling import SamplingParams
from events.hashing import BlockHasher, to_wire
from events.schema import BlockRemoved, BlockStored

BS = 4


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, params=SamplingParams(), max_tokens=1,
                   eos_token_ids=(), generator=torch.Generator())


def _computed(kv: KVCacheManager, req: Request) -> list[bytes]:
    """Admit ``req`` with nothing cached and mark its whole prompt computed."""
    digests = req.block_digests(kv.hasher, req.num_tokens // BS)
    assert kv.allocate_for_admission(req, digests, 0, 0, req.num_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    return digests


def test_forgetting_a_bad_request_takes_whoever_shares_its_blocks() -> None:
    """R1 and R2 computed the same prefix in one step; R2 registered after R1 and switched to
    R1's blocks (prefix-cache duplicates). R1's KV is wrong: its blocks leave the cache, and R2,
    which now reads them, must be redone too. R3, with other tokens, is untouched."""
    kv = KVCacheManager([KVCacheGroupSpec(0, "full_attention", None, (0,))], 32, BS, BlockHasher(block_size=BS))
    same, other = list(range(2 * BS)), list(range(100, 100 + 2 * BS))
    r1, r2, r3 = _request("r1", same), _request("r2", same), _request("r3", other)
    digests = _computed(kv, r1)
    _computed(kv, r2)
    _computed(kv, r3)
    new = [nb for r in (r1, r2, r3) for nb in kv.register_full_blocks(r)]
    assert [nb.request_id for nb in new] == ["r1", "r3"]  # r2's blocks were duplicates
    assert kv.block_table("r2") == kv.block_table("r1")
    kv.take_events()

    assert kv.forget_blocks(new, {"r1"}, [r1, r2, r3]) == {"r1", "r2"}
    pool = kv.pools[0]
    assert all(pool.get_cached_block(d) is None for d in digests)
    assert all(pool.get_cached_block(d) is not None for d in r3.block_digests(kv.hasher, 2))
    events = kv.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(removed) == len(events) == len(digests)
    assert {h for e in removed for h in e.block_hashes} == {to_wire(d) for d in digests}


def test_forgetting_nothing_shared_keeps_the_others() -> None:
    kv = KVCacheManager([KVCacheGroupSpec(0, "full_attention", None, (0,))], 32, BS, BlockHasher(block_size=BS))
    r1, r2 = _request("r1", list(range(BS))), _request("r2", list(range(50, 50 + BS)))
    _computed(kv, r1)
    _computed(kv, r2)
    new = [nb for r in (r1, r2) for nb in kv.register_full_blocks(r)]
    assert any(isinstance(e, BlockStored) for e in kv.take_events())
    assert kv.forget_blocks(new, {"r1"}, [r1, r2]) == {"r1"}
    assert kv.pools[0].get_cached_block(r2.block_digests(kv.hasher, 1)[0]) is not None
    assert kv.pools[0].get_cached_block(r1.block_digests(kv.hasher, 1)[0]) is None


def _cached_prefix(kv: KVCacheManager, tokens: list[int]) -> list[bytes]:
    """``tokens`` computed, registered and freed: their full blocks sit cached in the free queue."""
    r = _request("first", tokens)
    digests = _computed(kv, r)
    kv.register_full_blocks(r)
    kv.free(r)
    return digests


def _refs(kv: KVCacheManager, ids: list[int]) -> list[int]:
    return [kv.pools[0].blocks[b].ref_cnt for b in ids]


def test_an_admission_takes_over_the_hold_of_its_hits() -> None:
    """Held blocks that are the admission's hits keep the hold's one reference each (none taken
    twice, none dropped); the free queue is as the hold left it."""
    kv = KVCacheManager([KVCacheGroupSpec(0, "full_attention", None, (0,))], 16, BS, BlockHasher(block_size=BS))
    digests = _cached_prefix(kv, list(range(4 * BS)))
    held = kv.hold_blocks(digests, 4)
    queue = list(kv.pools[0].free_queue)
    assert _refs(kv, held[0]) == [1] * 4 and not set(held[0]) & set(queue)
    req = _request("r", [*range(4 * BS), 9])
    assert kv.allocate_for_admission(req, digests, 4, 0, 1, held) is not None
    assert kv.block_table("r")[0][:4] == held[0]
    assert _refs(kv, held[0]) == [1] * 4
    assert list(kv.pools[0].free_queue) == queue[1:]  # only the fresh block for the last token left it
    kv.free(req)
    assert _refs(kv, held[0]) == [0] * 4 and kv.pools[0].num_free_blocks == 16


def test_an_admission_releases_a_hold_that_is_not_its_hits() -> None:
    """The hold covers 2 blocks, the admission hits 4 (more were cached meanwhile): the 4 are
    the admission's, each referenced once; a short pool leaves the hold as it was."""
    kv = KVCacheManager([KVCacheGroupSpec(0, "full_attention", None, (0,))], 16, BS, BlockHasher(block_size=BS))
    digests = _cached_prefix(kv, list(range(4 * BS)))
    held = kv.hold_blocks(digests, 2)
    req = _request("r", [*range(4 * BS), 9])
    assert kv.allocate_for_admission(req, digests, 4, 0, 13 * BS, held) is None  # 13 more blocks: 12 free
    assert _refs(kv, held[0]) == [1, 1] and "r" not in kv.block_tables
    assert kv.allocate_for_admission(req, digests, 4, 0, 1, held) is not None
    hits = kv.block_table("r")[0][:4]
    assert hits[:2] == held[0] and _refs(kv, hits) == [1] * 4
    kv.free(req)
    assert kv.pools[0].num_free_blocks == 16
