"""A tier's tail read after the export's instant (offloadd.log.later_read, DECISIONS 81) on a real
Redis: a tier that evicts from its front while its tail is read yields the checkpoint of the
instant exactly; a change the read cannot place (a tail block removed or stored again, a hash
removed twice, the tier cleared) gives that checkpoint up, and the next one, which copies the
tails at its instant, is exact whatever happens during it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from events.checkpoint_cut import pieces
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from events.state import CacheState
from offloadd.log.checkpoint import CheckpointFailed, Manifest
from offloadd.log.metadata import MetadataStore
from tests.offloadd.test_checkpoint_incremental import Rig, scenario

Change = Callable[[Rig], Awaitable[None]]


async def state_at(rig: Rig, offset: int) -> CacheState:
    """The log replayed up to ``offset``: what a checkpoint at that offset must hold."""
    fresh = MetadataStore(rig.client, rig.keys, CacheState())
    async for records in fresh.iter_log(start=1):
        for record in records:
            if record.offset <= offset:
                fresh.state.apply(record)
    return fresh.state


async def assert_exact(rig: Rig, manifest: Manifest) -> None:
    """Its chunks are a full cut of the state at its offset; recovery from it is the state."""
    expected = await state_at(rig, manifest.offset)
    assert list(manifest.chunks) == [p.address for p in pieces(expected.tiers(), rig.cp.cuts, {}, set())]
    assert await rig.restored() == rig.md.state


async def evicting(rig: Rig) -> None:
    """A tier the book maps (mapped by the first export, changed since) with a tail to read."""
    rig.cp.fork_blocks = 1_000_000  # in the loop
    rig.cp.read_window = 16  # many windows: changes land between them
    await rig.store(0, 1000)
    assert await rig.cp.write() is not None
    await rig.put(BlockRemoved((500,), "GPU"))
    await rig.store(1000, 400)


async def export_while(rig: Rig, *changes: Change) -> Manifest:
    """A checkpoint written while ``changes`` are applied, one after each turn of the loop."""
    task = asyncio.create_task(rig.cp.write())
    await past_the_instant(rig, task)
    for change in changes:
        await change(rig)
        await asyncio.sleep(0)
    manifest = await task
    assert manifest is not None and rig.md.state.offset > manifest.offset
    return manifest


async def past_the_instant(rig: Rig, task: asyncio.Task[Manifest | None]) -> None:
    """Once the export has begun (its instant is behind it): what is applied from here on is
    not in its checkpoint."""
    while not rig.cp._book.begun:
        assert not task.done()
        await asyncio.sleep(0)


def removed(*hashes: int) -> Change:
    return lambda rig: rig.put(BlockRemoved(hashes, "GPU"))


def stored(h: int, tokens: tuple[int, int] = (7, 7)) -> Change:
    return lambda rig: rig.put(BlockStored((h,), None, tokens, 2, "GPU"))


def appended(first: int) -> Change:
    return lambda rig: rig.store(first, 20)


def test_a_tier_evicting_from_its_front_meanwhile_gives_the_instants_checkpoint(
        redis_url: str, namespace: str) -> None:
    async def body(rig: Rig) -> None:
        await evicting(rig)
        front = [removed(h, h + 1) for h in range(0, 200, 10)]  # before the tail: blocks 0..
        again = [stored(h) for h in (300, 301, 700)]  # stored again in place, before the tail
        grow = [appended(5000 + 20 * i) for i in range(10)]
        manifest = await export_while(rig, *[c for trio in zip(front, grow, again, strict=False)
                                             for c in trio], *front[10:])
        assert not rig.cp.stats.forked
        await assert_exact(rig, manifest)
        # Evicting on: the next checkpoint cuts around the holes and reads its tail again.
        manifest = await export_while(rig, removed(600, 601), appended(6000), removed(602))
        await assert_exact(rig, manifest)

    scenario(redis_url, namespace, body)


@pytest.mark.parametrize("change", ["tail removed", "mapped tail removed", "tail stored again", "appended then removed",
                                    "removed twice", "cleared"])
def test_a_change_the_read_cannot_place_gives_it_up_and_the_next_copies(
        redis_url: str, namespace: str, change: str) -> None:
    """Each change here moves (or may move) a tail block from where the read looks for it: the
    checkpoint is given up with the previous in force. The next export copies its tails at its
    instant, so it is exact even with the same change under it."""
    async def body(rig: Rig) -> None:
        await evicting(rig)
        first = (await rig.kept())[0]
        moves: list[Change] = {
            "tail removed": [removed(1390)],  # appended since the previous cut
            "mapped tail removed": [removed(999)],  # in the previous cut's last segment
            "tail stored again": [stored(1390)],
            "appended then removed": [appended(7000), removed(7005)],
            # 20 lies before the tail; stored again after its removal it is appended at the end,
            # so its second removal is of a block after the tail.
            "removed twice": [removed(20), stored(20), removed(20)],
            "cleared": [lambda rig: rig.put(AllBlocksCleared("GPU")), appended(8000)],
        }[change]
        with pytest.raises(CheckpointFailed, match="given up"):
            await export_while(rig, *moves)
        assert (await rig.kept())[0].ckpt_id == first.ckpt_id
        await rig.store(9000, 400)
        manifest = await export_while(rig, removed(9391), appended(9500), stored(9392))
        await assert_exact(rig, manifest)
        # And tails are read after the instant again from the checkpoint after.
        await rig.store(10_000, 400)
        with pytest.raises(CheckpointFailed, match="given up"):
            await export_while(rig, removed(10_390))

    scenario(redis_url, namespace, body)


def test_the_export_after_one_given_up_copies_its_tails(redis_url: str, namespace: str) -> None:
    """A tier that changes under every read still gets checkpointed: the export after one given
    up copies its tails at its instant. (Here the book still maps the tier from its first
    export, so without that rule the next export would read its tail after the instant again.)"""
    async def body(rig: Rig) -> None:
        rig.cp.fork_blocks = 1_000_000
        rig.cp.read_window = 16
        await rig.store(0, 1000)
        assert await rig.cp.write() is not None
        await rig.store(1000, 400)
        with pytest.raises(CheckpointFailed, match="given up"):
            await export_while(rig, removed(1390))
        await rig.store(2000, 400)
        manifest = await export_while(rig, removed(2390), appended(3000), stored(2391))
        await assert_exact(rig, manifest)

    scenario(redis_url, namespace, body)


@pytest.mark.parametrize("watched", [True, False])
def test_the_first_export_after_a_restart_knows_which_tiers_evict(
        redis_url: str, namespace: str, watched: bool) -> None:
    """A new daemon's checkpointer watches the reducer from its start (Checkpointer.run): its
    first export copies the tail of a tier that evicted meanwhile at its instant, and evictions
    during the export leave it exact. Not watched, the tier looks append-only: its tail is read
    after the instant and the first eviction gives the export up."""
    async def body(rig: Rig) -> None:
        rig.cp.fork_blocks = 1_000_000
        rig.cp.read_window = 16
        await rig.store(0, 1000)  # what recovery restored
        if watched:
            rig.cp.watch()
        await rig.put(BlockRemoved((0, 1), "GPU"))  # the engine evicts before the first export
        await rig.store(1000, 20)
        changes = (removed(2, 3), appended(2000), removed(4))
        if not watched:
            with pytest.raises(CheckpointFailed, match="given up"):
                await export_while(rig, *changes)
            return
        manifest = await export_while(rig, *changes)
        await assert_exact(rig, manifest)

    scenario(redis_url, namespace, body)
