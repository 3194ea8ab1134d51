"""A fork that fails (EAGAIN, ENOMEM: what a large daemon meets under memory pressure) costs
one export in the loop, not the checkpoint, nor file descriptors (offloadd.log.forked_export,
DECISIONS 51): the checkpoint is written, exact, and cut around the removals as a loop export
would be, not whole."""

from __future__ import annotations

import errno
import os

import pytest

from events.schema import BlockRemoved
from offloadd.log import checkpoint
from tests.offloadd.test_checkpoint_delta_redis import full_cut, written
from tests.offloadd.test_checkpoint_incremental import Rig, scenario


def _no_fork() -> int:
    raise OSError(errno.EAGAIN, "Resource temporarily unavailable")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux /proc")
def test_a_failed_fork_exports_in_the_loop_around_the_removals(
        redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(rig: Rig) -> None:
        rig.cp.fork_blocks = 0  # every export forked
        await rig.store(0, 2000)
        await written(rig)
        assert rig.cp.stats.forked
        # Holes in many segments: more touched blocks than a forked export would copy at the
        # instant (the plan limit, lowered here), so a forked export would cut the tier whole.
        monkeypatch.setattr(checkpoint, "_PLAN_BLOCKS", 100)
        await rig.put(BlockRemoved(tuple(range(5, 2000, 97)), "GPU"))
        monkeypatch.setattr(os, "fork", _no_fork)
        fds = len(os.listdir("/proc/self/fd"))
        failed = rig.cp.stats.num_failed
        manifest = await rig.cp.write()
        assert manifest is not None and list(manifest.chunks) == full_cut(rig)
        assert not rig.cp.stats.forked and rig.cp.stats.num_failed == failed
        assert len(os.listdir("/proc/self/fd")) == fds  # the export pipe closed
        # In the loop the limit does not apply: the segments around the holes, not all 1,980.
        assert rig.cp.stats.blocks_cut < 1500
        assert await rig.restored() == rig.md.state

    scenario(redis_url, namespace, body)
