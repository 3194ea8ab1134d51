"""With ``--redis-wait-replicas``, a write its replica did not acknowledge is in doubt, and stays
in doubt until the replica has it (DECISIONS 59): a real primary and a real replica, the replica
paused with SIGSTOP so that WAIT times out, then resumed with SIGCONT.

Before: the read-back found the write on the primary and applied it at once, a resend was acked
DUPLICATE while no replica had it, the next writes piled up on the primary unacknowledged, and
the batch queued behind the write in doubt was refused (ChainBroken) although its predecessor
had landed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from events.codec_proto import EventBatch
from events.logkeys import LogKeys
from events.records import RECORD_FIELD, decode_record
from events.schema import BlockStored
from events.state import CacheState
from offloadd.log.ingest import Ack, AckStatus, Ingest
from offloadd.log.metadata import MetadataStore, RedisUnavailable, WriteInDoubt
from tests.support.redis_proc import RedisProcess

# Each WAIT against the paused replica costs this much; a live replica's acknowledgement once
# took longer than 400 ms on a CI machine right after its sync (the first, unpaused write was
# refused as in doubt), so the margin is wide.
WAIT_MS = 1000


class Replica:
    """A replica of ``primary`` that can be paused (its WAIT acknowledgements stop) and resumed."""

    def __init__(self, workdir: Path, primary: RedisProcess) -> None:
        self.server = RedisProcess(workdir)
        self.server.start()
        admin = redis.Redis(port=primary.port)
        client = redis.Redis(port=self.server.port)
        try:
            admin.config_set("repl-diskless-sync-delay", 0)  # default 5 s: sync at once
            client.replicaof("127.0.0.1", primary.port)
            deadline = time.monotonic() + 15
            while True:  # until it acknowledges a write (WAIT counts it only from then on)
                admin.set("replica-ready", 1)
                if admin.wait(1, 200) >= 1:
                    break
                assert time.monotonic() < deadline, "the replica did not sync"
        finally:
            client.close()
            admin.close()
        self.paused = False

    def pause(self) -> None:
        assert self.server.proc is not None
        os.kill(self.server.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.paused and self.server.proc is not None:
            os.kill(self.server.proc.pid, signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        self.resume()
        self.server.stop(kill=True)


@pytest.fixture
def replica(tmp_path: Path, own_redis: RedisProcess) -> Iterator[Replica]:
    rep = Replica(tmp_path / "replica", own_redis)
    yield rep
    rep.stop()


def _stored(h: int) -> BlockStored:
    return BlockStored((h,), None, (1, 2, 3, 4), 4, "GPU")


def _batch(seq: int) -> EventBatch:
    return EventBatch("e", 1, seq, 0.0, (_stored(seq),))


def _logged_seqs(url: str, keys: LogKeys) -> list[int]:
    admin = redis.Redis.from_url(url)
    try:
        entries: Any = admin.xrange(keys.log)
        return [decode_record(f[RECORD_FIELD]).source_seq for _, f in entries]
    finally:
        admin.close()


def _ingest(url: str, keys: LogKeys) -> tuple[aioredis.Redis, MetadataStore, Ingest]:
    client = aioredis.Redis.from_url(url)
    md = MetadataStore(client, keys, CacheState())
    md.wait_for_replicas(1, WAIT_MS)
    ingest = Ingest(md, md.state, max_batch_events=16)
    ingest.log_epoch = "epoch-1"
    return client, md, ingest


def _brief(ack: Ack) -> tuple[AckStatus, int, int]:
    return ack.status, ack.acked_seq, ack.log_offset


def test_a_write_no_replica_acknowledged_is_settled_only_once_one_has_it(
    own_redis: RedisProcess, replica: Replica,
) -> None:
    """Batch 2 lands on the primary while the replica is paused: in doubt, and so are its resend
    and the batch after it (UNAVAILABLE, nothing more written to the primary, memory at 1). The
    replica resumes: the resend is a DUPLICATE, batch 3 is applied at offset 3."""
    keys = LogKeys("paused")

    async def scenario() -> dict[str, object]:
        client, md, ingest = _ingest(own_redis.url, keys)
        seen: dict[str, object] = {"first": _brief(await ingest.publish(_batch(1)))}
        replica.pause()
        second = await ingest.submit(_batch(2))
        await asyncio.sleep(0.05)  # batch 2's write is in flight: 3 goes in the next one
        third = await ingest.submit(_batch(3))  # fenced against 2
        seen["paused"] = await asyncio.gather(second, third, return_exceptions=True)
        with pytest.raises(RedisUnavailable, match="not yet confirmed by its replicas"):
            await ingest.publish(_batch(2))  # the resend: no ack while no replica has it
        seen["while_paused"] = (md.is_in_doubt, md.head, _logged_seqs(own_redis.url, keys))
        replica.resume()
        seen["resend"] = _brief(await ingest.publish(_batch(2)))
        seen["next"] = _brief(await ingest.publish(_batch(3)))
        seen["after"] = (md.is_in_doubt, md.head, md.state.fence("e"), md.state.violations)
        await client.aclose()
        return seen

    seen = asyncio.run(scenario())
    assert seen["first"] == (AckStatus.APPLIED, 1, 1)
    paused: Any = seen["paused"]
    second, third = paused
    assert isinstance(second, WriteInDoubt) and "replicas behind" in str(second)
    assert isinstance(third, RedisUnavailable) and "not yet confirmed" in str(third)
    assert seen["while_paused"] == (True, 1, [1, 2])  # batch 3 never reached the primary
    assert seen["resend"] == (AckStatus.DUPLICATE, 2, 0)
    assert seen["next"] == (AckStatus.APPLIED, 3, 3)
    assert seen["after"] == (False, 3, (1, 3), [])
    assert _logged_seqs(own_redis.url, keys) == [1, 2, 3]


def test_a_batch_queued_behind_a_write_in_doubt_that_landed_is_written(
    own_redis: RedisProcess, replica: Replica,
) -> None:
    """Batch 3 waits in the writer's queue behind batch 2, whose WAIT times out (the replica is
    paused); the replica resumes as batch 2 fails: the writer settles 2 as landed before it
    builds 3's write, and 3 is applied, not refused as following a batch that was not written."""
    keys = LogKeys("queued")

    async def scenario() -> tuple[list[object], list[int]]:
        client, md, ingest = _ingest(own_redis.url, keys)
        await ingest.publish(_batch(1))
        replica.pause()
        second = await ingest.submit(_batch(2))
        await asyncio.sleep(0.05)  # batch 2's write is in flight: 3 goes in the next one
        third = await ingest.submit(_batch(3))
        second.add_done_callback(lambda _: replica.resume())
        outcomes = await asyncio.gather(second, third, return_exceptions=True)
        await client.aclose()
        return list(outcomes), [md.head, *(md.state.fence("e") or ())]

    outcomes, memory = asyncio.run(scenario())
    assert isinstance(outcomes[0], WriteInDoubt)
    assert isinstance(outcomes[1], Ack) and _brief(outcomes[1]) == (AckStatus.APPLIED, 3, 3)
    assert memory == [3, 1, 3]
    assert _logged_seqs(own_redis.url, keys) == [1, 2, 3]
