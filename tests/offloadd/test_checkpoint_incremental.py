"""Incremental checkpoints on a real Redis (DECISIONS 60): a checkpoint writes only the chunks
that changed since the kept ones, a chunk a kept checkpoint lists is never deleted, a chunk gone
before the swap fails the checkpoint (the previous one stays), a restarted daemon reuses what
Redis holds, and format 1 checkpoints of an older daemon still load and are swept once dropped."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from events.checkpoint import (
    Manifest,
    candidates,
    checkpoint_id,
    decode_ids,
    decode_manifest,
    encode_chunk,
    encode_ids,
    encode_manifest,
    split,
)
from events.checkpoint_cut import Cuts
from events.logkeys import LogKeys
from events.schema import BlockRemoved, BlockStored, Event
from events.state import CacheState
from events.subscriber import KvEventSubscriber
from kvctl.main import main as kvctl
from offloadd.config import OffloaddConfig
from offloadd.log.checkpoint import Checkpointer, CheckpointFailed, restore
from offloadd.log.metadata import Append, MetadataStore
from tests.bridge.test_trimmed_log import bootstrap_at
from tests.kvctl.test_daemon import _from_json
from tests.support.bridge_proc import BridgeProcess

EPOCH = "e" * 16


class Rig:
    def __init__(self, client: Any, keys: LogKeys) -> None:
        self.client, self.keys = client, keys
        self.md = MetadataStore(client, keys, CacheState())
        self.cp = self.checkpointer()
        self.seq = 0

    def checkpointer(self) -> Checkpointer:
        cp = Checkpointer(self.md, OffloaddConfig(namespace=self.keys.namespace), EPOCH)
        cp.cuts = Cuts(8, 8, 32)
        return cp

    async def put(self, *events: Event) -> None:
        self.seq += 1
        await self.md.append(Append("engine", 1, self.seq, events, lambda pipe: None, lambda record: None))

    async def store(self, first: int, n: int) -> None:
        """``n`` blocks from hash ``first``, as records of 25 single-block events."""
        for at in range(first, first + n, 25):
            await self.put(*(BlockStored((h,), None, (h, h + 1), 2, "GPU") for h in range(at, min(at + 25, first + n))))

    async def chunk_keys(self) -> set[str]:
        return {k.decode() async for k in self.client.scan_iter(match=self.keys.checkpoint_content("*"))}

    async def kept(self) -> list[Manifest]:
        ids = decode_ids(await self.client.get(self.keys.checkpoint))
        return [decode_manifest(await self.client.get(self.keys.checkpoint_manifest(i)), i) for i in ids]

    async def restored(self) -> CacheState:
        fresh = MetadataStore(self.client, self.keys, CacheState())
        loaded = await restore(fresh)
        assert loaded is not None
        async for records in fresh.iter_log(start=loaded.offset + 1):
            for record in records:
                fresh.state.apply(record)
        return fresh.state


def scenario(redis_url: str, namespace: str, body: Callable[[Rig], Awaitable[None]]) -> None:
    async def run() -> None:
        client = aioredis.Redis.from_url(redis_url)
        keys = LogKeys(namespace)
        await client.set(keys.epoch, EPOCH)  # what recovery sets for a new log
        try:
            await body(Rig(client, keys))
        finally:
            await client.aclose()

    asyncio.run(run())


def test_the_second_checkpoint_writes_only_the_chunks_that_changed(redis_url: str, namespace: str) -> None:
    async def body(rig: Rig) -> None:
        await rig.store(0, 2000)
        first = await rig.cp.write()
        assert first is not None and first.format == 2 and len(first.chunks) >= 2000 // 40
        full = rig.cp.stats.bytes_sent
        assert full == first.num_bytes and len(await rig.chunk_keys()) == len(set(first.chunks))
        before = await rig.chunk_keys()
        await rig.store(2000, 40)  # appended: the last segment changes, new ones follow
        await rig.put(BlockRemoved((1000,), "GPU"))  # one segment in the middle changes
        second = await rig.cp.write()
        assert second is not None
        added = await rig.chunk_keys() - before
        changed = [a for a in second.chunks if a not in first.chunks]
        assert {rig.keys.checkpoint_content(a) for a in changed} == added
        assert 2 <= len(added) <= 2 + 40 // 8 + 1 + 2, len(added)
        assert rig.cp.stats.bytes_sent * 10 < full, (rig.cp.stats.bytes_sent, full)
        # Both load: the daemon's recovery, and the readers of the bridge and kvctl.
        assert await rig.restored() == rig.md.state
        sync = redis.Redis.from_url(_url(rig))
        got = list(candidates(rig.keys, sync.mget, EPOCH, 1))
        sync.close()
        assert [c.ckpt_id for c in got] == [second.ckpt_id, first.ckpt_id]
        assert got[0].snapshot is not None and CacheState.from_snapshot(got[0].snapshot) == rig.md.state

    scenario(redis_url, namespace, body)


def _url(rig: Rig) -> str:
    kw = rig.client.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}"


def test_dropped_checkpoints_take_only_the_chunks_no_kept_one_lists(redis_url: str, namespace: str) -> None:
    async def body(rig: Rig) -> None:
        await rig.store(0, 1000)
        first = await rig.cp.write()
        assert first is not None
        head = first.chunks[0]  # blocks 0.. are never touched: every checkpoint lists this chunk
        for round_ in range(5):
            await rig.store(10_000 + 100 * round_, 60)
            await rig.put(BlockRemoved(tuple(range(200 + 100 * round_, 230 + 100 * round_)), "GPU"))
            assert await rig.cp.write() is not None
            kept = await rig.kept()
            listed = {rig.keys.checkpoint_content(a) for m in kept for a in m.chunks}
            assert len(kept) == 2 and await rig.chunk_keys() == listed  # none missing, none left over
            assert head in kept[0].chunks and head in kept[1].chunks
        assert await rig.restored() == rig.md.state

    scenario(redis_url, namespace, body)


def test_a_listed_chunk_gone_before_the_swap_fails_the_checkpoint(redis_url: str, namespace: str) -> None:
    async def body(rig: Rig) -> None:
        await rig.store(0, 500)
        first = await rig.cp.write()
        assert first is not None
        await rig.client.delete(rig.keys.checkpoint_content(first.chunks[0]))  # reused next time
        await rig.store(500, 10)
        with pytest.raises(CheckpointFailed, match="is gone: not swapped"):
            await rig.cp.write()
        assert [m.ckpt_id for m in await rig.kept()] == [first.ckpt_id]
        second = await rig.cp.write()  # what Redis holds read again: the chunk is written anew
        assert second is not None and await rig.client.exists(rig.keys.checkpoint_content(first.chunks[0]))
        assert await rig.restored() == rig.md.state

    scenario(redis_url, namespace, body)


def test_a_restarted_daemon_sends_only_what_redis_lacks(redis_url: str, namespace: str) -> None:
    async def body(rig: Rig) -> None:
        await rig.store(0, 1500)
        first = await rig.cp.write()
        assert first is not None
        rig.cp = rig.checkpointer()  # a new process: no fingerprints, no events held
        await rig.cp.prime()
        await rig.store(1500, 20)
        second = await rig.cp.write()
        assert second is not None and 0 < rig.cp.stats.bytes_sent * 10 < first.num_bytes
        assert await rig.restored() == rig.md.state

    scenario(redis_url, namespace, body)


def test_a_format_1_checkpoint_loads_and_is_swept_once_dropped(redis_url: str, namespace: str) -> None:
    async def body(rig: Rig) -> None:
        await rig.store(0, 300)
        keys, snap = rig.keys, rig.md.state.export()
        old_id = checkpoint_id(EPOCH, snap.offset)
        chunks = [encode_chunk(part) for part in split(snap, 100)]  # as a daemon before format 2
        for i, (data, _) in enumerate(chunks):
            await rig.client.set(keys.checkpoint_chunk(old_id, i), data)
        await rig.client.set(keys.checkpoint_manifest(old_id), encode_manifest(Manifest(
            old_id, snap.offset, EPOCH, time.time(), tuple(c for _, c in chunks), 0)))
        await rig.client.set(keys.checkpoint, encode_ids([old_id]))
        assert await rig.restored() == rig.md.state
        await rig.cp.prime()
        for n in range(2):
            await rig.store(1000 + 10 * n, 10)
            assert await rig.cp.write() is not None
        names = {k.decode() async for k in rig.client.scan_iter(match=keys.checkpoint_manifest("*"))}
        assert not {n for n in names if n.startswith(keys.checkpoint_manifest(old_id))}
        assert await rig.restored() == rig.md.state

    scenario(redis_url, namespace, body)


def test_kv_bridge_and_kvctl_bootstrap_from_a_checkpoint_of_shared_chunks(
    redis_url: str, namespace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Two checkpoints sharing most of their chunks, the log trimmed past the older one's tail:
    kv-bridge (a real process) and kvctl start from the newer one plus the tail."""
    got: list[Any] = []

    async def body(rig: Rig) -> None:
        await rig.store(0, 600)
        first = await rig.cp.write()
        await rig.store(5000, 100)
        await rig.put(BlockRemoved(tuple(range(100, 140)), "GPU"))
        second = await rig.cp.write()
        assert first is not None and second is not None
        shared = set(first.chunks) & set(second.chunks)
        assert len(shared) >= len(second.chunks) // 2 and len(second.chunks) > 10
        await rig.store(7000, 50)  # the tail
        await rig.client.xtrim(rig.keys.log, minid=f"{second.offset + 1}-0", approximate=False)
        got.extend((second, rig.md.state))

    scenario(redis_url, namespace, body)
    second, state = got
    doc_src = [redis_url, "--namespace", namespace]
    assert kvctl(["replay", *doc_src, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["from"] == f"from checkpoint at offset {second.offset}"
    assert doc["offset"] == state.offset and _from_json(doc)[0] == state.view()
    bridge = BridgeProcess(redis_url, tmp_path / "b", namespace=namespace)
    bridge.start()
    try:
        with KvEventSubscriber(bridge.pub, bridge.replay) as sub:
            bootstrap_at(sub, state.offset)
            assert sub.view() == state.view()
    finally:
        bridge.stop()
