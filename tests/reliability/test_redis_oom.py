"""Redis out of memory (``maxmemory`` reached, policy ``noeviction``): every write refused.

A daemon under it answers Publish with UNAVAILABLE naming the refusal, keeps serving reads and
stays up; the engine keeps its batches. Once memory is there again every batch is written once,
a checkpoint covers them and a kill -9 restart recovers that state. A checkpoint whose writes
are refused leaves the previous one in force, and a restart from there loses nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from events.logkeys import LogKeys
from events.schema import BlockStored
from kvctl.main import main as kvctl_main
from offloadd.client import IngestStream, OffloadClient
from offloadd.log.checkpoint import CheckpointFailed
from tests.offloadd.test_checkpoint import CKPT_ARGS, head, pointer, publish, wait_checkpoint
from tests.offloadd.test_checkpoint_incremental import Rig, scenario
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_proc import RedisProcess


def _out_of_memory(admin: redis.Redis) -> None:
    """Every write that needs memory refused from here on (reads and deletes still served)."""
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)


def test_publish_while_redis_is_out_of_memory_loses_nothing(
    own_redis: RedisProcess, tmp_path: Path, namespace: str,
) -> None:
    proc = DaemonProcess(tmp_path / "d", own_redis.url, namespace, extra_args=CKPT_ARGS)
    keys, admin = LogKeys(namespace), redis.Redis.from_url(own_redis.url)
    proc.start()
    stream = IngestStream(proc.target, "gpu-engine", 3)
    try:
        publish(stream, 0, 300)
        in_force = wait_checkpoint(admin, keys, 300)
        _out_of_memory(admin)
        for i in range(300, 500):
            stream.submit([BlockStored((i,), None, (1, 2, 3, 4), 4, "GPU")])
        assert not stream.flush(3)
        assert stream.acked_seq == 300 and stream.num_pending == 200
        assert "UNAVAILABLE" in stream.last_error and "maxmemory" in stream.last_error, stream.last_error
        assert proc.proc is not None and proc.proc.poll() is None, proc.log_tail()
        assert head(admin, keys) == 300 and pointer(admin, keys)[0] == in_force.ckpt_id
        with OffloadClient(proc.target) as c:  # reads are served meanwhile
            assert c.snapshot().offset == 300

        admin.config_set("maxmemory", 0)
        assert stream.flush(30), stream.last_error
        assert head(admin, keys) == 500 and stream.num_resets == 0
        wait_checkpoint(admin, keys, 500)
        with OffloadClient(proc.target) as c:
            before = c.snapshot()
        gpu = [s for s in before.sources if s.source == "gpu-engine"]
        assert len(gpu) == 1 and {h for e in gpu[0].events for h in e.block_hashes} == set(range(500))
        proc.kill()
        proc.restart()
        with OffloadClient(proc.target) as c:
            assert c.snapshot() == before
        assert kvctl_main(["verify", own_redis.url, "--namespace", namespace]) == 0
    finally:
        stream.close()
        proc.kill()
        admin.close()


def test_a_checkpoint_refused_for_memory_leaves_the_previous_one_in_force(
    own_redis: RedisProcess, namespace: str,
) -> None:
    """In process: the log is written, then Redis runs out of memory before the checkpoint."""

    async def body(rig: Rig) -> None:
        admin = redis.Redis.from_url(own_redis.url)
        await rig.store(0, 100)
        first = await rig.cp.write()
        assert first is not None
        await rig.store(100, 100)
        _out_of_memory(admin)
        with pytest.raises(CheckpointFailed, match="maxmemory"):
            await rig.cp.write()
        assert [m.ckpt_id for m in await rig.kept()] == [first.ckpt_id]
        # A restart from here loads the previous checkpoint and replays the rest.
        assert await rig.restored() == rig.md.state
        admin.config_set("maxmemory", 0)
        second = await rig.cp.write()
        assert second is not None and second.offset == rig.md.state.offset
        assert [m.ckpt_id for m in await rig.kept()] == [second.ckpt_id, first.ckpt_id]
        admin.close()

    scenario(own_redis.url, namespace, body)
