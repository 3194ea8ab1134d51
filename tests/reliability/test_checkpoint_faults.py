"""Checkpoint faults: a write that fails midway leaves the previous checkpoint in force; a trimmed
log with no usable checkpoint stops startup with one line; the bridge replays from a trimmed seq
starting at the oldest retained record."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from events.checkpoint import chunk_keys
from events.checkpoint_cut import Cuts
from events.logkeys import LogKeys
from events.schema import BlockStored
from events.state import CacheState
from events.subscriber import KvEventSubscriber
from offloadd.client import OffloadClient
from offloadd.config import OffloaddConfig
from offloadd.log.checkpoint import Checkpointer, CheckpointFailed, checkpoint_id, restore
from offloadd.log.metadata import Append, MetadataStore
from tests.offloadd.test_checkpoint import (
    ckpt_stack,
    first_offset,
    head,
    log_epoch,
    manifest,
    pointer,
    publish,
    recovery_counts,
    wait_checkpoint,
)
from tests.support.bridge_proc import BridgeProcess, FleetSimulator, LogWriter


def test_checkpoint_write_failing_midway_keeps_the_previous_one(
    tmp_path: Path, redis_url: str, namespace: str,
) -> None:
    with ckpt_stack(tmp_path, redis_url, namespace) as st:
        proc, keys, admin, stream = st.proc, st.keys, st.admin, st.stream
        publish(stream, 0, 200)
        wait_checkpoint(admin, keys, head(admin, keys))
        # The next checkpoint's chunks get written, then its manifest key is of the wrong type:
        # the swap is refused and the pointer stays on the previous checkpoint. The key is
        # planted at every offset the 100 records bring (a slow machine checkpoints while they
        # arrive), so each checkpoint meanwhile is refused as well.
        now, epoch = head(admin, keys), log_epoch(admin, keys)
        for offset in range(now + 1, now + 101):
            admin.rpush(keys.checkpoint_manifest(checkpoint_id(epoch, offset)), "not a manifest")
        doomed = checkpoint_id(epoch, now + 100)
        publish(stream, 200, 100)
        deadline = time.monotonic() + 10
        while b"WRONGTYPE" not in proc.log_path.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b"WRONGTYPE" in proc.log_path.read_bytes(), proc.log_tail()
        with OffloadClient(proc.target) as c:
            before = c.snapshot()
        assert before.offset == int(doomed.split("-")[0])
        assert doomed not in pointer(admin, keys)
        good = manifest(admin, keys, pointer(admin, keys)[0])  # still in force, older
        assert good.offset < before.offset and first_offset(admin, keys) <= good.offset + 1
        proc.kill()
        proc.restart()
        num_records, ckpt_offset = recovery_counts(proc)
        assert (num_records, ckpt_offset) == (before.offset - good.offset, good.offset)
        with OffloadClient(proc.target) as c:
            assert c.snapshot() == before
        # Once the key is gone, the next attempt succeeds.
        admin.delete(keys.checkpoint_manifest(doomed))
        assert wait_checkpoint(admin, keys, before.offset).ckpt_id == doomed


def test_trimmed_log_without_a_usable_checkpoint_stops_startup(
    tmp_path: Path, redis_url: str, namespace: str,
) -> None:
    with ckpt_stack(tmp_path, redis_url, namespace) as st:
        proc, keys, admin, stream = st.proc, st.keys, st.admin, st.stream
        publish(stream, 0, 300)
        wait_checkpoint(admin, keys, head(admin, keys))
        publish(stream, 300, 300)
        wait_checkpoint(admin, keys, head(admin, keys))
        deadline = time.monotonic() + 10
        while first_offset(admin, keys) <= 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first_offset(admin, keys) > 1
        proc.kill()
        for ckpt_id in pointer(admin, keys):
            admin.delete(*chunk_keys(keys, manifest(admin, keys, ckpt_id))[:1])
        with pytest.raises(RuntimeError, match="exited with 1"):
            proc.restart()
        lines = [ln for ln in proc.log_tail(5).splitlines() if "refusing to start" in ln]
        assert len(lines) == 1 and lines[0].startswith("offloadd: the log"), proc.log_tail()


def test_bridge_replays_a_trimmed_seq_from_the_oldest_retained_record(
    redis_url: str, tmp_path: Path,
) -> None:
    client = redis.Redis.from_url(redis_url)
    writer, sim = LogWriter(client), FleetSimulator(["engine-a"], seed=2)
    bridge = BridgeProcess(redis_url, tmp_path, "--start", "beginning")
    bridge.start()
    live = KvEventSubscriber(bridge.pub, bridge.replay, "kv-events")
    late = KvEventSubscriber(bridge.pub, bridge.replay, "kv-events")
    seqs: list[int] = []
    late.on_batch(lambda seq, _batch: seqs.append(seq))
    try:
        assert live.bootstrap() == 0
        sim.write(writer, 40)
        assert live.run_until(lambda s: s.next_seq == 40), bridge.output()
        client.xtrim(LogKeys().log, minid="31-0", approximate=False)  # what the daemon's retention does
        assert late.replay_from(5) == 10
        assert seqs == list(range(30, 40))  # offset 31 is seq 30: the jump shows
        assert late.stats.lost == 25
        sim.write(writer, 5)  # the bridge keeps publishing
        assert live.run_until(lambda s: s.next_seq == 45), bridge.output()
        # A bridge behind a moving horizon: down while offsets 46..65 are written and 46..55
        # trimmed, it reports the gap and goes on from 56 with seq 55 (= offset - 1).
        bridge.stop()
        sim.write(writer, 20)
        client.xtrim(LogKeys().log, minid="56-0", approximate=False)
        bridge.args = ["--start", "resume"]  # from its saved position, offset 45
        bridge.start()
        sim.write(writer, 1)
        deadline = time.monotonic() + 10
        while "kvbridge_log_gap_records_total 10.0" not in bridge.metrics():
            assert time.monotonic() < deadline, bridge.output()
            time.sleep(0.05)
        assert "log gap: offsets jump from 45 to 56" in bridge.output()
        fresh = KvEventSubscriber(bridge.pub, bridge.replay, "kv-events")
        got: list[int] = []
        fresh.on_batch(lambda seq, _batch: got.append(seq))
        fresh.replay_from(50)
        fresh.close()
        assert got == list(range(55, 66))
    finally:
        live.close()
        late.close()
        bridge.stop()
        client.close()


def test_redis_failing_between_chunks_leaves_the_previous_checkpoint_in_force(
    redis_url: str, namespace: str,
) -> None:
    """In process: the script call after the second chunk fails as if Redis went away."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        keys = LogKeys(namespace)
        md = MetadataStore(client, keys, CacheState())
        await client.set(keys.epoch, "e" * 16)  # what recovery sets for a new log

        async def append(n: int, start: int) -> None:
            for i in range(start, start + n):
                await md.append(Append("e", 1, i + 1, (BlockStored((i,), None, (1, 2, 3, 4), 4, "GPU"),),
                                       lambda pipe: None, lambda record: None))

        cp = Checkpointer(md, OffloaddConfig(namespace=namespace), "e" * 16)
        cp.cuts, cp.batch_bytes = Cuts(3, 1, 3), 1  # chunks of 3 blocks, each in its own call
        await append(10, 0)
        first = await cp.write()
        assert first is not None and len(first.chunks) == 4
        await append(10, 10)
        real, calls = cp.store._script, []

        async def failing(**kw: Any) -> Any:
            calls.append(kw)
            if len(calls) > 2:
                raise redis.ConnectionError("Redis went away")
            return await real(**kw)

        cp.store._script = failing
        with pytest.raises(CheckpointFailed, match="went away"):
            await cp.write()
        assert len(calls) == 3  # two new chunks written (blocks 9-11, 12-14), the third refused
        assert pointer(redis.Redis.from_url(redis_url), keys) == (first.ckpt_id,)
        # A restart from here loads the previous checkpoint and replays the rest.
        fresh = MetadataStore(client, keys, CacheState())
        loaded = await restore(fresh)
        assert loaded == first
        async for records in fresh.iter_log(start=first.offset + 1):
            for record in records:
                fresh.state.apply(record)
        assert fresh.state.export() == md.state.export()
        # Redis is back: the next write succeeds and removes the unfinished one's chunks.
        cp.store._script = real
        second = await cp.write()
        assert second is not None and second.offset == 20
        names = {k.decode().split(":")[3] async for k in client.scan_iter(match=keys.checkpoint_manifest("*"))}
        assert names == {first.ckpt_id, second.ckpt_id, "chunk"}
        stored = {k.decode() async for k in client.scan_iter(match=keys.checkpoint_content("*"))}
        assert stored == {keys.checkpoint_content(a) for a in {*first.chunks, *second.chunks}}
        await client.aclose()

    asyncio.run(scenario())
