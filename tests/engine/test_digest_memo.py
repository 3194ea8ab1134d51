"""engine.digest_memo: digests remembered across requests are the hasher's own digests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.digest_memo import DigestMemo
from engine.llm import LLM
from engine.sampling import SamplingParams
from events.hashing import BlockHasher


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxh3_128_cbor"])
def test_memo_gives_the_hashers_digests(algo: str) -> None:
    hasher = BlockHasher("seed", 16, algo)  # type: ignore[arg-type]
    memo = DigestMemo(hasher, 1000)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 128256, 16 * 20 + 5).astype(np.int64)  # a partial block at the end
    assert memo.hash_blocks(prompt) == hasher.hash_blocks(prompt) and memo.hits == 0
    assert memo.hash_blocks(prompt.tolist()) == hasher.hash_blocks(prompt.tolist()) and memo.hits == 20
    # A prompt sharing 8 blocks, then other tokens: 8 hits, the rest hashed after the last hit.
    other = np.concatenate([prompt[:128], rng.integers(0, 128256, 100)])
    assert memo.hash_blocks(other) == hasher.hash_blocks(other) and memo.hits == 28
    # Same tokens after another parent are other blocks.
    parent = hasher.hash_blocks(other)[-1]
    assert memo.hash_blocks(prompt, parent) == hasher.hash_blocks(prompt, parent) and memo.hits == 28
    assert memo.hash_blocks(prompt[:15]) == []


def test_memo_stays_bounded_and_exact() -> None:
    hasher = BlockHasher("seed", 4, "sha256_cbor")
    memo = DigestMemo(hasher, 64)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 1000, 4 * 30) for _ in range(10)]
    for _ in range(2):
        for p in prompts:
            assert memo.hash_blocks(p) == hasher.hash_blocks(p)
            assert len(memo) <= 64


def test_a_prefix_hit_hashes_nothing_seen_before(plain_model: Path) -> None:
    llm = LLM(str(plain_model), max_num_batched_tokens=256)
    memo = llm.engine.kv.hasher
    assert isinstance(memo, DigestMemo)
    prompt = np.random.default_rng(2).integers(0, 256, 200).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    first = llm.generate(prompt, params)[0]
    hits = memo.hits
    again = llm.generate([*prompt, 7, 8], params)[0]
    assert again.num_cached_tokens == 192 and first.num_cached_tokens == 0
    assert memo.hits - hits == 12  # the 12 full blocks of the first prompt, none hashed again
    assert len(again.outputs[0].token_ids) == 3


def test_blocks_seen_after_other_parents_are_still_exact() -> None:
    """The same tokens in many places of a chain (a run of one token, and a block that also
    opens another prompt): the one-pass lookup finds them remembered after other parents and
    the memo goes on block by block; every digest is the hasher's, all from the memo."""
    hasher = BlockHasher("seed", 4, "sha256_cbor")
    memo = DigestMemo(hasher, 1000)
    same = np.full(4 * 12, 7, dtype=np.int64)  # 12 equal blocks, 12 different parents
    lead = np.concatenate([same[:4], np.arange(100, 120)])  # block 0 of both, then others
    for p in (same, lead):
        assert memo.hash_blocks(p) == hasher.hash_blocks(p)
    hits = memo.hits
    for p in (same, lead, same[:20]):
        assert memo.hash_blocks(p) == hasher.hash_blocks(p)
    assert memo.hits - hits == 12 + 6 + 5
    tail = hasher.hash_blocks(same[:8])[-1]  # block 2 of the run, with block 1's digest given
    assert memo.hash_blocks(same[8:12], tail) == hasher.hash_blocks(same[:12])[2:]


def test_whole_runs_are_looked_up_and_a_run_shared_in_part_still_hits() -> None:
    """Runs of RUN_BLOCKS blocks are remembered from a call's first block; a prompt sharing
    the first run and part of the second finds the whole run, then goes block by block (the
    shared blocks still hits), and every digest is the hasher's."""
    from engine.digest_memo import RUN_BLOCKS

    bs = 4
    hasher = BlockHasher("seed", bs, "sha256_cbor")
    memo = DigestMemo(hasher, 1000)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 1000, bs * (2 * RUN_BLOCKS + 3) + 1)  # two whole runs, 3 blocks, a partial
    assert memo.hash_blocks(prompt) == hasher.hash_blocks(prompt) and memo.hits == 0
    assert len(memo._runs) == 2
    assert memo.hash_blocks(prompt) == hasher.hash_blocks(prompt) and memo.hits == 2 * RUN_BLOCKS + 3
    cut = bs * (RUN_BLOCKS + 5)  # the first run and 5 blocks of the second, then other tokens
    other = np.concatenate([prompt[:cut], rng.integers(1000, 2000, bs * RUN_BLOCKS)])
    hits = memo.hits
    assert memo.hash_blocks(other) == hasher.hash_blocks(other)
    assert memo.hits - hits == RUN_BLOCKS + 5
    assert len(memo._runs) == 3  # the other prompt's second run is remembered now
    hits = memo.hits
    assert memo.hash_blocks(other) == hasher.hash_blocks(other) and memo.hits - hits == 2 * RUN_BLOCKS + 5
    # A run after another parent is another run: the same tokens chained after a digest.
    parent = hasher.hash_blocks(other)[-1]
    assert memo.hash_blocks(prompt, parent) == hasher.hash_blocks(prompt, parent)


def test_runs_stay_bounded_and_exact() -> None:
    from engine.digest_memo import RUN_BLOCKS

    hasher = BlockHasher("seed", 2, "xxh3_128_cbor")
    memo = DigestMemo(hasher, 4 * RUN_BLOCKS)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 1000, 2 * RUN_BLOCKS * 3) for _ in range(6)]
    for _ in range(2):
        for p in prompts:
            assert memo.hash_blocks(p) == hasher.hash_blocks(p)
            assert len(memo._runs) <= 4 and len(memo) <= 4 * RUN_BLOCKS
