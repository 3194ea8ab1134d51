"""The daemon's checkpoints cut only what was appended or around what was removed
(events.checkpoint_delta) on a real Redis: in the loop or in a forked child, each checkpoint lists exactly the chunks of a full cut
of the state at its offset, recovery from it is the state, and a checkpoint that failed between
two leaves the previous in force and the next one exact."""

from __future__ import annotations

import asyncio

import pytest

from events.checkpoint_cut import pieces
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from events.state import CacheState
from offloadd.config import ConfigError, OffloaddConfig
from offloadd.log.checkpoint import CheckpointFailed, Manifest, restore
from offloadd.log.metadata import MetadataStore
from tests.offloadd.test_checkpoint_incremental import Rig, scenario
from tests.offloadd.test_later_read import past_the_instant


def full_cut(rig: Rig) -> list[str]:
    return [p.address for p in pieces(rig.md.state.tiers(), rig.cp.cuts, {}, set())]


async def written(rig: Rig) -> Manifest:
    manifest = await rig.cp.write()
    assert manifest is not None
    assert list(manifest.chunks) == full_cut(rig)  # nothing applied since: the same instant
    return manifest


@pytest.mark.parametrize("forked", [False, True])
def test_appends_are_cut_alone_and_recovery_is_the_state(redis_url: str, namespace: str,
                                                         forked: bool) -> None:
    async def body(rig: Rig) -> None:
        rig.cp.fork_blocks = 0 if forked else 1_000_000
        await rig.store(0, 2000)
        await rig.put(BlockStored((50_000, 50_001), None, (1, 2, 3, 4), 2, "CPU"))
        await written(rig)
        assert rig.cp.stats.blocks_cut == 2002 and rig.cp.stats.forked == forked
        for round_ in range(3):
            await rig.store(2000 + 40 * round_, 40)
            await written(rig)
            assert 40 < rig.cp.stats.blocks_cut <= 40 + 2 * rig.cp.cuts.max  # not 2000
            assert rig.cp.stats.forked == forked
            assert await rig.restored() == rig.md.state
        # The first hole in a tier that only grew: it kept no map of its segments since the
        # first export (DECISIONS 74), so it is cut whole once, and mapped from then on.
        await rig.put(BlockRemoved((1000,), "GPU"))
        await rig.store(9000, 60)
        await written(rig)
        assert rig.cp.stats.blocks_cut > 2000 and rig.cp.stats.forked == forked
        assert await rig.restored() == rig.md.state
        # The next hole: only the segments it touched are cut again, in the loop or the child.
        await rig.put(BlockRemoved((1500,), "GPU"))
        await rig.store(9100, 60)
        await written(rig)
        assert rig.cp.stats.blocks_cut < 200 and rig.cp.stats.forked == forked
        assert await rig.restored() == rig.md.state
        await rig.put(AllBlocksCleared("GPU"))  # cut whole: the child sends its segments' hashes
        await rig.store(20_000, 500)
        await written(rig)
        assert rig.cp.stats.blocks_cut == 502
        rig.cp.fork_blocks = 1_000_000  # in the loop from here: what that cut mapped is used
        await rig.put(BlockRemoved((20_010, 20_300, 20_499), "GPU"))
        await written(rig)
        assert rig.cp.stats.blocks_cut < 200 and not rig.cp.stats.forked
        assert await rig.restored() == rig.md.state

    scenario(redis_url, namespace, body)


def test_a_failed_checkpoint_between_two_leaves_the_next_exact(redis_url: str, namespace: str) -> None:
    async def body(rig: Rig) -> None:
        await rig.store(0, 1000)
        first = await written(rig)
        await rig.store(1000, 40)
        # A chunk the kept checkpoint lists (and the next one reuses as it was) is lost: the
        # swap refuses, the first checkpoint stays in force.
        await rig.client.delete(rig.keys.checkpoint_content(first.chunks[0]))
        with pytest.raises(CheckpointFailed, match="is gone"):
            await rig.cp.write()
        assert (await rig.kept())[0].ckpt_id == first.ckpt_id
        await rig.store(1040, 40)
        await written(rig)  # the lost chunk's tier cut whole again, every chunk written
        assert rig.cp.stats.blocks_cut == 1080
        listed = {rig.keys.checkpoint_content(a) for m in await rig.kept() for a in m.chunks}
        assert await rig.chunk_keys() >= listed
        await rig.store(1080, 10)
        await written(rig)
        assert rig.cp.stats.blocks_cut < 1000  # and incremental again
        assert await rig.restored() == rig.md.state

    scenario(redis_url, namespace, body)


def test_a_negative_fork_threshold_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="checkpoint_fork_blocks: must be >= 0"):
        OffloaddConfig(checkpoint_fork_blocks=-1)


def test_a_tier_that_only_grew_is_read_after_the_instant_and_appends_meanwhile_do_not_leak_in(
        redis_url: str, namespace: str) -> None:
    """In the loop, a tier that never changed otherwise than by appends is not copied at the
    export's instant but read when its turn comes, a window at a time (DECISIONS 74): records
    appended meanwhile are not in the checkpoint, whose recovery plus its tail is the state."""
    async def body(rig: Rig) -> None:
        rig.cp.fork_blocks = 1_000_000
        rig.cp.read_window = 16  # many windows: appends land between them
        await rig.store(0, 1000)
        await written(rig)
        await rig.store(1000, 400)
        task = asyncio.create_task(rig.cp.write())
        for i in range(20):  # applied while the export runs: after its instant
            await rig.store(5000 + 10 * i, 10)
        manifest = await task
        assert manifest is not None and rig.md.state.offset > manifest.offset
        assert rig.cp.stats.blocks_cut >= 400 and not rig.cp.stats.forked
        back = await rig.restored()
        assert back == rig.md.state
        loaded = MetadataStore(rig.client, rig.keys, CacheState())
        await restore(loaded)
        assert len(loaded.state.resident("engine", "GPU")) == 1400  # the instant's blocks only

    scenario(redis_url, namespace, body)


@pytest.mark.parametrize("change", ["removed", "stored again"])
def test_a_removal_while_a_tier_is_read_after_the_instant_gives_the_checkpoint_up(
        redis_url: str, namespace: str, change: str) -> None:
    """The tier's first removal lands while the export reads it: a tier that only grew keeps no
    map of its segments after its second export (DECISIONS 74), so the read cannot tell whether
    the instant's blocks are still where they were (offloadd.log.later_read), and that
    checkpoint fails (the previous stays in force); the next is exact. So does a block stored
    again by a new event: a window looks its blocks' events up by hash, which holds only while
    each maps to the instant's event."""
    async def body(rig: Rig) -> None:
        rig.cp.fork_blocks = 1_000_000
        rig.cp.read_window = 16
        await rig.store(0, 1000)
        await written(rig)
        await rig.store(1000, 40)
        first = await written(rig)  # the tier only grew: its map is dropped
        await rig.store(1040, 360)
        task = asyncio.create_task(rig.cp.write())
        await past_the_instant(rig, task)
        if change == "removed":
            await rig.put(BlockRemoved((10,), "GPU"))
        else:  # in the stretch still to be read, with other tokens than the instant's
            await rig.put(BlockStored((1390,), None, (7, 7), 2, "GPU"))
        with pytest.raises(CheckpointFailed, match="given up"):
            await task
        assert (await rig.kept())[0].ckpt_id == first.ckpt_id
        await written(rig)  # the tier has changed: cut whole, and exact
        assert await rig.restored() == rig.md.state

    scenario(redis_url, namespace, body)
